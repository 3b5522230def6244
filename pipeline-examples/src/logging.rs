//! The CLI's log lines: one voice for a user, the detail on request.
//!
//! By default (no `--log`, no `RUST_LOG`) warnings and errors of the library are written as
//! the CLI writes its own lines, `gpipe: warning: consumer died: its socket closed; its slots
//! were taken back (consumer 0, pid 4242)`: no timestamps, levels in words, no module paths.
//! `--log FILTER` or `RUST_LOG` asks for more, and gets the detailed format: time, level,
//! module path and fields, as tracing writes them.
//!
//! Either way, the deaths of consumers that `gpipe soak` killed on purpose are expected, not
//! warnings: they are left out unless the filter shows debug lines (the soak reports them as
//! a count).

use std::fmt::{self, Write as _};

use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

/// Sets up logging to stderr. `log` is `--log` (None: not given).
pub fn init(log: Option<&str>) {
    let rust_log = std::env::var_os("RUST_LOG").is_some_and(|v| !v.is_empty());
    // RUST_LOG first, as before; a filter it cannot parse falls back to --log.
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(log.unwrap_or("warn")));
    let expected = ExpectedDeaths {
        shown: filter
            .max_level_hint()
            .is_some_and(|l| l >= LevelFilter::DEBUG),
    };
    let base = tracing_subscriber::registry().with(filter);
    let detailed = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(use_color(
            std::io::IsTerminal::is_terminal(&std::io::stderr()),
            std::env::var_os("NO_COLOR"),
        ));
    if rust_log || log.is_some() {
        base.with(detailed).with(expected).init();
    } else {
        let voice = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .event_format(CliVoice);
        base.with(voice).with(expected).init();
    }
}

/// Colour in logs only on a terminal, and never when `NO_COLOR` is set to anything non-empty
/// (no-color.org): `gpipe produce ... 2>log` writes plain text.
fn use_color(stderr_is_terminal: bool, no_color: Option<std::ffi::OsString>) -> bool {
    stderr_is_terminal && no_color.is_none_or(|v| v.is_empty())
}

/// An event's message and its other fields, as text.
#[derive(Default)]
struct Fields {
    message: String,
    others: Vec<(&'static str, String)>,
    pid: Option<u64>,
}

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.record_text(field, format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.record_text(field, value.to_string());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "pid" {
            self.pid = Some(value);
        }
        self.record_text(field, value.to_string());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        if field.name() == "pid" {
            self.pid = u64::try_from(value).ok();
        }
        self.record_text(field, value.to_string());
    }
}

impl Fields {
    fn of(event: &Event<'_>) -> Self {
        let mut f = Fields::default();
        event.record(&mut f);
        f
    }
    fn record_text(&mut self, field: &Field, text: String) {
        match field.name() {
            "message" => self.message = text,
            name => {
                if name == "pid" && self.pid.is_none() {
                    self.pid = text.parse().ok();
                }
                self.others.push((name, text));
            }
        }
    }
}

/// The terminal format: `gpipe: warning: MESSAGE (FIELD VALUE, ...)`.
struct CliVoice;

impl<S, N> FormatEvent<S, N> for CliVoice
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        writer.write_str(&cli_line(*event.metadata().level(), &Fields::of(event)))
    }
}

/// One log line in the CLI's voice, newline included.
fn cli_line(level: Level, fields: &Fields) -> String {
    let mut line = String::from("gpipe: ");
    line.push_str(match level {
        Level::ERROR => "error: ",
        Level::WARN => "warning: ",
        Level::INFO => "",
        _ => "debug: ",
    });
    line.push_str(&fields.message);
    if !fields.others.is_empty() {
        let others: Vec<String> = fields
            .others
            .iter()
            .map(|(name, value)| format!("{} {value}", name.replace('_', " ")))
            .collect();
        let _ = write!(line, " ({})", others.join(", "));
    }
    line.push('\n');
    line
}

/// Leaves out the warnings about consumers `gpipe soak` killed on purpose (any warning whose
/// `pid` field names one), unless debug lines are `shown`.
struct ExpectedDeaths {
    shown: bool,
}

impl<S: Subscriber> Layer<S> for ExpectedDeaths {
    fn event_enabled(&self, event: &Event<'_>, _ctx: Context<'_, S>) -> bool {
        if self.shown || *event.metadata().level() != Level::WARN {
            return true;
        }
        !Fields::of(event)
            .pid
            .is_some_and(crate::soak::killed_on_purpose)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(use_color(true, None));
        assert!(!use_color(false, None));
        assert!(!use_color(true, Some("1".into())));
        assert!(use_color(true, Some("".into())));
    }

    #[test]
    fn a_warning_reads_like_the_cli_s_own_lines() {
        let fields = Fields {
            message: "consumer died: its socket closed".into(),
            others: vec![("consumer", "0".into()), ("pid", "4242".into())],
            pid: Some(4242),
        };
        assert_eq!(
            cli_line(Level::WARN, &fields),
            "gpipe: warning: consumer died: its socket closed (consumer 0, pid 4242)\n"
        );
        let bare = Fields {
            message: "attached".into(),
            ..Default::default()
        };
        assert_eq!(cli_line(Level::INFO, &bare), "gpipe: attached\n");
        assert_eq!(cli_line(Level::ERROR, &bare), "gpipe: error: attached\n");
    }
}
