//! Random draws: lease tokens, and 64 bits from the operating system.

/// A fresh lease token. Random, not a counter: a row deleted and claimed again must
/// never hand an old executor's token to a new one. Drawn without the system call
/// [`random_u64`] makes (a few microseconds per claim): std's randomly keyed
/// hasher over what no other draw shares, the process (a forked child inherits
/// its parent's thread state), the thread and a count of this thread's draws.
pub(crate) fn new_lease() -> i64 {
    use std::cell::Cell;
    use std::hash::{BuildHasher, RandomState};
    thread_local! {
        static DRAWN: Cell<u64> = const { Cell::new(0) };
    }
    let drawn = DRAWN.with(|drawn| {
        let n = drawn.get().wrapping_add(1);
        drawn.set(n);
        n
    });
    let input = (std::process::id(), std::thread::current().id(), drawn);
    i64::from_ne_bytes(RandomState::new().hash_one(input).to_ne_bytes())
}

/// 64 random bits from the operating system, or, where it fails, from std's
/// randomly keyed hasher over the time.
#[cfg(any(feature = "client", feature = "postgres", feature = "testing"))]
pub(crate) fn random_u64() -> u64 {
    getrandom::u64().unwrap_or_else(|_| {
        use std::hash::{BuildHasher, RandomState};
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        RandomState::new().hash_one(nanos)
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::new_lease;

    #[test]
    fn leases_never_repeat_across_threads() {
        let draws: Vec<Vec<i64>> = std::thread::scope(|scope| {
            let threads: Vec<_> = (0..4)
                .map(|_| scope.spawn(|| (0..50_000).map(|_| new_lease()).collect()))
                .collect();
            threads
                .into_iter()
                .map(|thread| thread.join().unwrap_or_default())
                .collect()
        });
        let all: HashSet<i64> = draws.iter().flatten().copied().collect();
        assert_eq!(draws.iter().map(Vec::len).sum::<usize>(), 200_000);
        assert_eq!(all.len(), 200_000, "a lease was drawn twice");
    }
}
