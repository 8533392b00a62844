//! What vnatd's journal entries say in `MESSAGE=`. tracing-journald sends
//! an event's message alone as `MESSAGE=` and its fields as separate journal
//! fields, which `journalctl -u vnatd` does not print: "cannot update the
//! translation" without the connection's id or the error. [`JournalLines`]
//! wraps that layer and hands it each event with its message replaced by
//! the line the text log would print after the level and target
//! ("cannot update the translation id=… flow=… error=…"), the fields of
//! the spans it is in (those the event does not name itself) at its end.
//! The fields still go as journal fields too.

use std::fmt::{self, Write};

use tracing::{
    field::{Field, Value, Visit},
    span, Event, Metadata, Subscriber,
};
use tracing_subscriber::{layer::Context, registry::LookupSpan, Layer};

/// The most fields an event can have in the rewritten copy (tracing's
/// macros take at most 32).
const MAX_FIELDS: usize = 32;

/// A layer that passes each event on to `inner` with its message made the
/// whole text line (see the module documentation).
pub struct JournalLines<L> {
    inner: L,
}

impl<L> JournalLines<L> {
    pub fn new(inner: L) -> Self {
        JournalLines { inner }
    }
}

/// An event's or a span's fields, as the text log writes them.
#[derive(Default)]
struct Fields {
    /// Each field with its value as text, in the order recorded.
    values: Vec<(Field, String)>,
}

impl Fields {
    fn push(&mut self, field: &Field, value: String) {
        self.values.push((field.clone(), value));
    }

    fn has(&self, name: &str) -> bool {
        self.values.iter().any(|(f, _)| f.name() == name)
    }
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.push(field, value.to_string());
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.push(field, value.to_string());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        // `%x` fields arrive here as their Display, `?x` as their Debug,
        // numbers and the message's format arguments as themselves.
        self.push(field, format!("{value:?}"));
    }
}

/// A span's fields as text, kept in its extensions for the events in it.
struct SpanFields(Vec<(&'static str, String)>);

/// The text line: the message, then `name=value` for each other field of
/// the event, then each field of its spans (outermost first) that the
/// event does not have.
fn line(event: &Fields, spans: &[(&'static str, String)]) -> String {
    let mut text = event
        .values
        .iter()
        .find(|(f, _)| f.name() == "message")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    let others = event
        .values
        .iter()
        .filter(|(f, _)| f.name() != "message")
        .map(|(f, v)| (f.name(), v.as_str()));
    let from_spans = spans
        .iter()
        .filter(|(name, _)| !event.has(name))
        .map(|(name, v)| (*name, v.as_str()));
    for (name, value) in others.chain(from_spans) {
        if !text.is_empty() {
            text.push(' ');
        }
        let _ = write!(text, "{name}={value}");
    }
    text
}

/// Call `f` with a copy of `event` whose `message` is `text` and whose
/// other fields are `recorded`'s values (as text: journald stores text
/// anyway). An event without a message field, or with more fields than a
/// copy can hold, is passed on as it is.
fn with_message(event: &Event<'_>, recorded: &Fields, text: &str, f: impl FnOnce(&Event<'_>)) {
    let meta: &'static Metadata<'static> = event.metadata();
    let Some(message) = meta.fields().field("message") else {
        return f(event);
    };
    if recorded.values.len() > MAX_FIELDS {
        return f(event);
    }
    let values: Vec<&str> = recorded.values.iter().map(|(_, v)| v.as_str()).collect();
    // Unused slots name the message field without a value, which a
    // visitor never sees.
    let mut entries: [(&Field, Option<&dyn Value>); MAX_FIELDS] = [(&message, None); MAX_FIELDS];
    for (i, (field, _)) in recorded.values.iter().enumerate() {
        let value: &dyn Value = if field.name() == "message" {
            &text
        } else {
            &values[i]
        };
        entries[i] = (field, Some(value));
    }
    let set = meta.fields().value_set(&entries);
    let copy = if event.is_contextual() {
        Event::new(meta, &set)
    } else {
        Event::new_child_of(event.parent().cloned(), meta, &set)
    };
    f(&copy)
}

impl<S, L> Layer<S> for JournalLines<L>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    L: Layer<S>,
{
    fn on_register_dispatch(&self, subscriber: &tracing::Dispatch) {
        self.inner.on_register_dispatch(subscriber);
    }

    fn on_layer(&mut self, subscriber: &mut S) {
        self.inner.on_layer(subscriber);
    }

    fn register_callsite(
        &self,
        metadata: &'static Metadata<'static>,
    ) -> tracing::subscriber::Interest {
        self.inner.register_callsite(metadata)
    }

    fn enabled(&self, metadata: &Metadata<'_>, ctx: Context<'_, S>) -> bool {
        self.inner.enabled(metadata, ctx)
    }

    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            let mut fields = Fields::default();
            attrs.record(&mut fields);
            let text = fields
                .values
                .into_iter()
                .map(|(f, v)| (f.name(), v))
                .collect();
            span.extensions_mut().insert(SpanFields(text));
        }
        self.inner.on_new_span(attrs, id, ctx);
    }

    fn on_record(&self, id: &span::Id, values: &span::Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            let mut fields = Fields::default();
            values.record(&mut fields);
            if let Some(kept) = span.extensions_mut().get_mut::<SpanFields>() {
                for (f, v) in fields.values {
                    match kept.0.iter_mut().find(|(name, _)| *name == f.name()) {
                        Some(slot) => slot.1 = v,
                        None => kept.0.push((f.name(), v)),
                    }
                }
            }
        }
        self.inner.on_record(id, values, ctx);
    }

    fn on_follows_from(&self, span: &span::Id, follows: &span::Id, ctx: Context<'_, S>) {
        self.inner.on_follows_from(span, follows, ctx);
    }

    fn event_enabled(&self, event: &Event<'_>, ctx: Context<'_, S>) -> bool {
        self.inner.event_enabled(event, ctx)
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let mut spans = Vec::new();
        if let Some(scope) = ctx.event_scope(event) {
            for span in scope.from_root() {
                if let Some(kept) = span.extensions().get::<SpanFields>() {
                    spans.extend(kept.0.iter().cloned());
                }
            }
        }
        let text = line(&fields, &spans);
        with_message(event, &fields, &text, |copy| self.inner.on_event(copy, ctx));
    }

    fn on_enter(&self, id: &span::Id, ctx: Context<'_, S>) {
        self.inner.on_enter(id, ctx);
    }

    fn on_exit(&self, id: &span::Id, ctx: Context<'_, S>) {
        self.inner.on_exit(id, ctx);
    }

    fn on_close(&self, id: span::Id, ctx: Context<'_, S>) {
        self.inner.on_close(id, ctx);
    }

    fn on_id_change(&self, old: &span::Id, new: &span::Id, ctx: Context<'_, S>) {
        self.inner.on_id_change(old, new, ctx);
    }
}
