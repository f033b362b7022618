//! devices-sim: simulates many devices on bad links against edgeway.
fn main() {}
