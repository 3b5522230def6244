//! Criterion benchmarks of the gpipe ring (placeholder until written).
fn main() {}
