//! Byte sizes with units: `8MiB`, `64KiB`, `2G`, `1048576`.

/// Parses a size. K/KiB, M/MiB, G/GiB are powers of 1024; KB, MB, GB powers of 1000.
pub fn parse(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (examples: 4096, 64KiB, 8MiB, 1GiB)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        u => {
            return Err(format!(
                "unknown size unit {u:?} in {s:?} (use KiB, MiB, GiB)"
            ));
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// Formats a size with a binary unit when exact.
pub fn format(b: u64) -> String {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if b >= 1 << shift && b % (1 << shift) == 0 {
            return format!("{} {unit}", b >> shift);
        }
    }
    format!("{b} B")
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
        assert_eq!(parse("4096").unwrap(), 4096);
        assert!(parse("8XB").is_err());
        assert!(parse("MiB").is_err());
        assert!(parse("99999999999999GiB").is_err());
        assert_eq!(format(8 << 20), "8 MiB");
        assert_eq!(format(1000), "1000 B");
    }
}
