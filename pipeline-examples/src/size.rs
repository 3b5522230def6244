//! Byte sizes with units: `8MiB`, `1.5MiB`, `64KiB`, `2G`, `1048576`.

/// The most decimals a size may have (more would only be noise below a byte).
const MAX_DECIMALS: usize = 9;

/// Parses a size: a number, whole or with decimals, and a unit. K/KiB, M/MiB, G/GiB, T/TiB
/// are powers of 1024; KB, MB, GB, TB powers of 1000; no unit (or B) is bytes, which are
/// whole. A size with decimals is rounded to the nearest whole byte (`1.5MiB` is 1572864
/// bytes, `1.1MiB` 1153434).
pub fn parse(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let not_a_size = || format!("{s:?} is not a size (examples: 4096, 64KiB, 1.5MiB, 8MiB, 1GiB)");
    let (whole, decimals) = num.split_once('.').unwrap_or((num, ""));
    if (whole.is_empty() && decimals.is_empty()) || decimals.contains('.') {
        return Err(not_a_size());
    }
    if decimals.len() > MAX_DECIMALS {
        return Err(format!(
            "{s:?} has more than {MAX_DECIMALS} decimals: a size is rounded to whole bytes"
        ));
    }
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        u => {
            return Err(format!(
                "unknown size unit {u:?} in {s:?} (use KiB, MiB, GiB, or bytes without a unit)"
            ));
        }
    };
    if mult == 1 && decimals.bytes().any(|d| d != b'0') {
        return Err(format!(
            "{s:?} is a fraction of a byte: a number of bytes is whole (or give a unit, as in 1.5KiB)"
        ));
    }
    let too_large = || format!("{s:?} is too large");
    // The number as an integer of tenths, hundredths, ...: exact arithmetic, no float.
    let scale = 10u128.pow(decimals.len() as u32);
    let digits: u128 = format!("{whole}{decimals}")
        .parse()
        .map_err(|_| too_large())?;
    let bytes = digits
        .checked_mul(u128::from(mult))
        .ok_or_else(too_large)?
        .checked_add(scale / 2)
        .ok_or_else(too_large)?
        / scale;
    u64::try_from(bytes).map_err(|_| too_large())
}

/// Formats a size with a binary unit when exact.
pub fn format(b: u64) -> String {
    pipeline_cuda::policy::bytes_text(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(parse("8MiB").unwrap(), 8 << 20);
        assert_eq!(parse("8M").unwrap(), 8 << 20);
        assert_eq!(parse("64KiB").unwrap(), 64 << 10);
        assert_eq!(parse("1GB").unwrap(), 1_000_000_000);
        assert_eq!(parse("2TiB").unwrap(), 2 << 40);
        assert_eq!(parse("4096").unwrap(), 4096);
        assert!(parse("8XB").is_err());
        assert!(parse("MiB").is_err());
        assert!(parse("99999999999999GiB").is_err());
        assert_eq!(format(8 << 20), "8 MiB");
        assert_eq!(format(1000), "1000 B");
    }

    #[test]
    fn decimals_round_to_whole_bytes() {
        assert_eq!(parse("1.5MiB").unwrap(), 3 << 19);
        assert_eq!(parse("0.5GiB").unwrap(), 1 << 29);
        assert_eq!(parse(".5KiB").unwrap(), 512);
        assert_eq!(parse("2.MiB").unwrap(), 2 << 20);
        assert_eq!(parse("1.25GB").unwrap(), 1_250_000_000);
        // 1.1 MiB is 1153433.6 bytes: the nearest whole byte.
        assert_eq!(parse("1.1MiB").unwrap(), 1_153_434);
        assert_eq!(parse("4096.0").unwrap(), 4096);
        assert!(parse("1.5").unwrap_err().contains("whole"));
        assert!(parse("1.2.3MiB").is_err());
        assert!(parse(".MiB").is_err());
        assert!(parse("1.0000000001GiB").unwrap_err().contains("decimals"));
        assert!(parse("17179869184.5GiB").unwrap_err().contains("too large"));
    }
}
