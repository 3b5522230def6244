//! Durations with units, wherever the CLI takes one: `30s`, `10m`, `1h`, `250ms`, or plain
//! seconds (`30`, `1.5`).

use std::time::Duration;

/// Parses a duration: a non-negative number with an optional unit `ms`, `s`, `m` or `h`
/// (seconds when there is none).
pub fn parse(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (examples: 30, 30s, 10m, 1h, 250ms)"))?;
    let secs = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "s" | "sec" | "secs" => n,
        "ms" => n / 1000.0,
        "m" | "min" | "mins" => n * 60.0,
        "h" | "hour" | "hours" => n * 3600.0,
        u => {
            return Err(format!(
                "unknown duration unit {u:?} in {s:?} (use ms, s, m or h)"
            ));
        }
    };
    Duration::try_from_secs_f64(secs).map_err(|_| format!("{s:?} is out of range"))
}

/// Plural for counts in messages: "1 consumer", "2 consumers".
pub fn plural(n: impl Into<u64>, one: &str, many: &str) -> String {
    let n = n.into();
    format!("{n} {}", if n == 1 { one } else { many })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_and_plain_seconds() {
        assert_eq!(parse("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse("10m").unwrap(), Duration::from_secs(600));
        assert_eq!(parse("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse("1.5").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse(" 2 m ").unwrap(), Duration::from_secs(120));
    }

    #[test]
    fn bad_input_is_refused_with_a_hint() {
        assert!(parse("").unwrap_err().contains("examples"));
        assert!(parse("soon").unwrap_err().contains("examples"));
        assert!(parse("3d").unwrap_err().contains("unit"));
        assert!(parse("-5s").is_err());
        assert!(parse("1e400").is_err());
    }

    #[test]
    fn plurals() {
        assert_eq!(plural(1u32, "consumer", "consumers"), "1 consumer");
        assert_eq!(plural(2u32, "consumer", "consumers"), "2 consumers");
        assert_eq!(plural(0u32, "consumer", "consumers"), "0 consumers");
    }
}
