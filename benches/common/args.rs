//! Command-line flags of the benches (`--name VALUE`).

/// The value after flag `name` in `args`, if the flag is given.
pub fn flag_value(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

/// The number after flag `name` in `args`, or `default` when the flag is not given; a value
/// that is not a number stops the bench with a message naming the flag.
#[allow(dead_code)]
pub fn number(args: &[String], name: &str, default: u64) -> u64 {
    flag_value(args, name).map_or(default, |v| {
        v.parse()
            .unwrap_or_else(|e| panic!("{name} {v}: not a number ({e})"))
    })
}
