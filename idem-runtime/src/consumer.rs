//! What the broker adapters share (docs/contract.md, "Messages"): how often a
//! message whose handler failed is tried again and how long apart, and what
//! each [`Processed`] comes to for a broker.

use std::fmt;
use std::time::Duration;

use crate::message::{Processed, Stuck};

/// How a consumer tries again a message whose handler failed: how many
/// attempts in all, and an exponential backoff between them. A message in
/// flight elsewhere, or one met while the database is unavailable, is tried
/// again without spending an attempt.
///
/// # Examples
///
/// ```
/// # extern crate idem_runtime as idem_axum;
/// use std::time::Duration;
/// use idem_axum::Retries;
///
/// let retries = Retries::new(4)
///     .backoff(Duration::from_secs(2), Duration::from_secs(5));
/// assert_eq!(retries.attempts(), 4);
/// assert_eq!(retries.delay(1), Duration::from_secs(2));
/// assert_eq!(retries.delay(2), Duration::from_secs(4));
/// assert_eq!(retries.delay(3), Duration::from_secs(5));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retries {
    attempts: u32,
    first: Duration,
    max: Duration,
}

impl Default for Retries {
    /// Five attempts, one second after the first failure, doubling up to a
    /// minute.
    fn default() -> Self {
        Self {
            attempts: 5,
            first: Duration::from_secs(1),
            max: Duration::from_secs(60),
        }
    }
}

impl Retries {
    /// `attempts` in all (one at least) before a failing message is
    /// dead-lettered, with the default backoff.
    pub fn new(attempts: u32) -> Self {
        Self {
            attempts: attempts.max(1),
            ..Self::default()
        }
    }

    /// Waits `first` after the first failure, twice as long after each next
    /// one, never longer than `max`.
    #[must_use]
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.first = first;
        self.max = max.max(first);
        self
    }

    /// How many attempts a message gets.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// The wait after the `failures`-th failure (1 for the first).
    pub fn delay(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(31);
        self.first
            .checked_mul(1 << doublings)
            .map_or(self.max, |delay| delay.min(self.max))
    }
}

/// What an adapter does with a delivery once it has been processed.
#[cfg_attr(not(any(feature = "lapin", feature = "async-nats")), allow(dead_code))]
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    /// Acknowledge it.
    Ack,
    /// Deliver it again after `after`; `failed` when this delivery spent an
    /// attempt.
    Later { after: Duration, failed: bool },
    /// Dead-letter it, for `reason`.
    DeadLetter(String),
}

/// The step for `processed`, the `attempt`-th (from 1) of its message.
#[cfg_attr(not(any(feature = "lapin", feature = "async-nats")), allow(dead_code))]
pub(crate) fn step<T, E: fmt::Display>(
    processed: &Processed<T, E>,
    attempt: u32,
    retries: &Retries,
) -> Step {
    let failed = |why: String| {
        if attempt >= retries.attempts {
            Step::DeadLetter(format!("failed {attempt} times; last: {why}"))
        } else {
            Step::Later {
                after: retries.delay(attempt),
                failed: true,
            }
        }
    };
    match processed {
        Processed::Ran(_) | Processed::Done(_) => Step::Ack,
        Processed::InFlight { retry_after } => Step::Later {
            after: *retry_after,
            failed: false,
        },
        Processed::Unavailable => Step::Later {
            after: retries.first,
            failed: false,
        },
        Processed::Failed(error) => failed(error.to_string()),
        Processed::Aborted(why) => failed(format!("{why:?}")),
        Processed::Mismatch { part } => {
            Step::DeadLetter(format!("the id was first used with another {part}"))
        }
        Processed::Refused(why) => Step::DeadLetter(why.to_string()),
        Processed::Stuck(why) => Step::DeadLetter(match why {
            Stuck::Ended => "its transaction was ended without its record".to_owned(),
            Stuck::Unreadable => "its record is sealed under a key not in the ring".to_owned(),
            Stuck::Undecodable(error) => format!("its record does not decode: {error}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Aborted;

    #[test]
    fn failures_spend_attempts_and_nothing_else_does() {
        let retries = Retries::new(3);
        let failed: Processed<(), &str> = Processed::Failed("declined");
        assert_eq!(
            step(&failed, 1, &retries),
            Step::Later {
                after: Duration::from_secs(1),
                failed: true
            }
        );
        assert_eq!(
            step(&failed, 2, &retries),
            Step::Later {
                after: Duration::from_secs(2),
                failed: true
            }
        );
        assert!(
            matches!(step(&failed, 3, &retries), Step::DeadLetter(why) if why.contains("declined"))
        );
        let panicked: Processed<(), &str> = Processed::Aborted(Aborted::Panicked);
        assert!(matches!(step(&panicked, 3, &retries), Step::DeadLetter(_)));
        let busy: Processed<(), &str> = Processed::InFlight {
            retry_after: Duration::from_secs(7),
        };
        let later = Step::Later {
            after: Duration::from_secs(7),
            failed: false,
        };
        assert_eq!(step(&busy, 99, &retries), later);
        let down: Processed<(), &str> = Processed::Unavailable;
        assert!(matches!(
            step(&down, 99, &retries),
            Step::Later { failed: false, .. }
        ));
    }

    #[test]
    fn the_backoff_doubles_up_to_its_bound_without_overflow() {
        let retries = Retries::new(100).backoff(Duration::from_millis(100), Duration::from_secs(3));
        let delays: Vec<_> = (1..=7).map(|n| retries.delay(n).as_millis()).collect();
        assert_eq!(delays, [100, 200, 400, 800, 1600, 3000, 3000]);
        assert_eq!(retries.delay(u32::MAX), Duration::from_secs(3));
        assert_eq!(Retries::new(0).attempts(), 1);
    }
}
