//! How the bench writes its figures: rates in three significant figures, and JSON objects
//! with their keys in alphabetical order.

/// Batches per second in three significant figures: 20.1k, 143k, 950.
pub(super) fn compact_rate(x: f64) -> String {
    if x >= 1e5 {
        format!("{:.0}k", x / 1e3)
    } else if x >= 1e4 {
        format!("{:.1}k", x / 1e3)
    } else if x >= 1e3 {
        format!("{:.2}k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

/// Serializes `value` through serde_json's map, as these figures came out when they were a
/// map: keys in alphabetical order, at every level (scripts and diffs of saved reports see
/// the same text).
pub(super) fn sorted_keys<T: serde::Serialize, S: serde::Serializer>(
    value: &T,
    s: S,
) -> Result<S::Ok, S::Error> {
    use serde::Serialize;
    serde_json::to_value(value)
        .map_err(serde::ser::Error::custom)?
        .serialize(s)
}

#[cfg(test)]
mod tests {
    use super::compact_rate;

    #[test]
    fn rates_in_three_figures() {
        assert_eq!(compact_rate(950.4), "950");
        assert_eq!(compact_rate(3_412.0), "3.41k");
        assert_eq!(compact_rate(20_138.0), "20.1k");
        assert_eq!(compact_rate(143_196.0), "143k");
    }
}
