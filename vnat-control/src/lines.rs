//! The protocol's framing: newline-delimited lines with a length bound, read
//! the same way by vnatd's server and by the client.

use tokio::io::{AsyncBufRead, AsyncBufReadExt};

/// One framed line, or why there is none.
#[derive(Debug, PartialEq, Eq)]
pub enum Line {
    /// A line without its `\n`. A last line cut short by EOF counts too, so
    /// that `printf '{...}' | socat - UNIX:...` gets an answer.
    Data(Vec<u8>),
    /// More than the bound arrived without a newline. The rest of the line is
    /// left unread: the caller answers and closes instead of draining it.
    TooLong,
    /// The peer closed between lines.
    Eof,
}

/// Read one line of at most `max` bytes (newline excluded) without ever
/// buffering more than `max` plus one read's worth.
pub async fn read_line_bounded<R: AsyncBufRead + Unpin>(
    reader: &mut R,
    max: usize,
) -> std::io::Result<Line> {
    read_line_bounded_into(reader, max, &mut Vec::new()).await
}

/// [`read_line_bounded`], cancel-safe: what it read of a line not yet
/// complete stays in `line`, which the caller keeps for the next call, so
/// a read dropped at a timeout loses no byte (bytes leave the reader only
/// once they are in `line`, with no await in between).
pub async fn read_line_bounded_into<R: AsyncBufRead + Unpin>(
    reader: &mut R,
    max: usize,
    line: &mut Vec<u8>,
) -> std::io::Result<Line> {
    let line_out = |line: &mut Vec<u8>| Line::Data(std::mem::take(line));
    loop {
        let available = reader.fill_buf().await?;
        if available.is_empty() {
            return Ok(if line.is_empty() {
                Line::Eof
            } else {
                line_out(line)
            });
        }
        if let Some(end) = available.iter().position(|b| *b == b'\n') {
            if line.len() + end > max {
                line.clear();
                return Ok(Line::TooLong);
            }
            line.extend_from_slice(&available[..end]);
            reader.consume(end + 1);
            return Ok(line_out(line));
        }
        let n = available.len();
        if line.len() + n > max {
            line.clear();
            return Ok(Line::TooLong);
        }
        line.extend_from_slice(available);
        reader.consume(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn read_all(input: &[u8], max: usize) -> Vec<Line> {
        // A tiny buffer makes lines span several fill_buf calls.
        let mut reader = tokio::io::BufReader::with_capacity(3, input);
        let mut out = Vec::new();
        loop {
            let line = read_line_bounded(&mut reader, max)
                .await
                .expect("reading a slice cannot fail");
            let stop = matches!(line, Line::Eof | Line::TooLong);
            out.push(line);
            if stop {
                return out;
            }
        }
    }

    #[tokio::test]
    async fn splits_lines_and_keeps_an_unterminated_last_one() {
        let got = read_all(b"ab\n\ncdefgh\nxyz", 10).await;
        assert_eq!(
            got,
            vec![
                Line::Data(b"ab".to_vec()),
                Line::Data(Vec::new()),
                Line::Data(b"cdefgh".to_vec()),
                Line::Data(b"xyz".to_vec()),
                Line::Eof
            ]
        );
    }

    /// A read dropped at a timeout in the middle of a line (a monitor's
    /// event written in two pieces) loses nothing: the next read returns
    /// the whole line. With a buffer local to each read, the next read
    /// returned the line's second half alone, a protocol error.
    #[tokio::test]
    async fn a_read_cancelled_mid_line_loses_nothing() {
        use tokio::io::AsyncWriteExt;
        let (mut w, r) = tokio::io::duplex(64);
        let mut reader = tokio::io::BufReader::new(r);
        let mut partial = Vec::new();
        w.write_all(b"{\"event\":").await.unwrap();
        let cut = tokio::time::timeout(
            std::time::Duration::from_millis(50),
            read_line_bounded_into(&mut reader, 100, &mut partial),
        )
        .await;
        assert!(cut.is_err(), "half a line must not be a line");
        w.write_all(b"\"moved\"}\n").await.unwrap();
        let line = read_line_bounded_into(&mut reader, 100, &mut partial)
            .await
            .unwrap();
        assert_eq!(line, Line::Data(b"{\"event\":\"moved\"}".to_vec()));
        assert!(partial.is_empty());
    }

    #[tokio::test]
    async fn bound_is_inclusive() {
        assert_eq!(
            read_all(b"12345\n", 5).await[0],
            Line::Data(b"12345".to_vec())
        );
        assert_eq!(read_all(b"123456\n", 5).await[0], Line::TooLong);
        assert_eq!(read_all(b"123456789", 5).await[0], Line::TooLong);
    }
}
