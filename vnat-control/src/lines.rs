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
    let mut line = Vec::new();
    loop {
        let available = reader.fill_buf().await?;
        if available.is_empty() {
            return Ok(if line.is_empty() {
                Line::Eof
            } else {
                Line::Data(line)
            });
        }
        if let Some(end) = available.iter().position(|b| *b == b'\n') {
            if line.len() + end > max {
                return Ok(Line::TooLong);
            }
            line.extend_from_slice(&available[..end]);
            reader.consume(end + 1);
            return Ok(Line::Data(line));
        }
        let n = available.len();
        if line.len() + n > max {
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
