//! [`named_enum!`]: the names and export-blob values of the backend's small option enums
//! ([`crate::memory::MemoryPath`], [`crate::memory::HandleKind`], [`crate::sync::SyncMode`],
//! [`crate::sync::TimelineMemory`]), from one table each.

/// `ALL`, `as_str`, `to_wire`, `from_wire`, `Display` and `FromStr` (case-insensitive, with
/// extra accepted spellings) for a fieldless enum, from a table of
/// `Variant = "name" (wire value) ["alias", ...]` rows, in the order `ALL` lists them.
macro_rules! named_enum {
    ($ty:ident, $what:literal, [$($var:ident = $name:literal ($wire:literal) [$($alias:literal),*]),+ $(,)?]) => {
        impl $ty {
            /// Every value, in the order of the table.
            pub const ALL: [$ty; [$($name),+].len()] = [$($ty::$var),+];

            /// The name the CLI, the Python package and the reports use.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($ty::$var => $name,)+
                }
            }

            /// Value in the export blob.
            pub fn to_wire(self) -> u32 {
                match self {
                    $($ty::$var => $wire,)+
                }
            }

            /// From the export blob's value (`None`: one this release does not know).
            pub fn from_wire(v: u32) -> Option<Self> {
                match v {
                    $($wire => Some($ty::$var),)+
                    _ => None,
                }
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $ty {
            type Err = String;

            fn from_str(s: &str) -> Result<Self, String> {
                let lower = s.to_ascii_lowercase();
                $(if lower == $name $(|| lower == $alias)* {
                    return Ok($ty::$var);
                })+
                Err(format!(
                    "unknown {} {s:?} (expected {})",
                    $what,
                    $crate::names::one_of(&[$($name),+])
                ))
            }
        }
    };
}

pub(crate) use named_enum;

/// `a`, `a or b`, `a, b or c`.
pub(crate) fn one_of(names: &[&str]) -> String {
    match names {
        [] => String::new(),
        [one] => (*one).to_string(),
        [head @ .., last] => format!("{} or {last}", head.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use crate::memory::{HandleKind, MemoryPath};
    use crate::sync::{SyncMode, TimelineMemory};

    #[test]
    fn lists_read_as_prose() {
        assert_eq!(super::one_of(&["a"]), "a");
        assert_eq!(super::one_of(&["a", "b"]), "a or b");
        assert_eq!(super::one_of(&["a", "b", "c"]), "a, b or c");
    }

    /// Names and wire values round-trip, aliases and any case parse, and a refusal lists the
    /// names. The wire values are the export blob's (docs/protocol.md): they never change.
    #[test]
    fn every_named_enum_round_trips_and_refuses_clearly() {
        fn check<T>(all: &[T], expected: &str)
        where
            T: Copy
                + PartialEq
                + std::fmt::Debug
                + std::fmt::Display
                + std::str::FromStr<Err = String>,
        {
            for v in all {
                assert_eq!(v.to_string().parse::<T>(), Ok(*v));
                assert_eq!(v.to_string().to_uppercase().parse::<T>(), Ok(*v));
            }
            let e = "nonsense".parse::<T>().unwrap_err();
            assert!(e.ends_with(&format!("(expected {expected})")), "{e}");
        }
        check(&MemoryPath::ALL, "pool, vmm or legacy");
        check(&HandleKind::ALL, "posix_fd or fabric");
        check(&SyncMode::ALL, "events or semaphore");
        check(&TimelineMemory::ALL, "host or device");
        for (v, w) in MemoryPath::ALL.iter().zip([1, 2, 3]) {
            assert_eq!((v.to_wire(), MemoryPath::from_wire(w)), (w, Some(*v)));
        }
        for (v, w) in HandleKind::ALL.iter().zip([1, 2]) {
            assert_eq!((v.to_wire(), HandleKind::from_wire(w)), (w, Some(*v)));
        }
        for (v, w) in SyncMode::ALL.iter().zip([1, 2]) {
            assert_eq!((v.to_wire(), SyncMode::from_wire(w)), (w, Some(*v)));
        }
        for (v, w) in TimelineMemory::ALL.iter().zip([1, 2]) {
            assert_eq!((v.to_wire(), TimelineMemory::from_wire(w)), (w, Some(*v)));
        }
        assert_eq!(MemoryPath::from_wire(0), None);
        assert_eq!(SyncMode::from_wire(3), None);
        assert_eq!("ipc".parse::<MemoryPath>(), Ok(MemoryPath::Legacy));
        assert_eq!("posix-fd".parse::<HandleKind>(), Ok(HandleKind::PosixFd));
    }
}
