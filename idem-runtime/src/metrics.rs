//! What idem reports through the [`metrics`](https://docs.rs/metrics) facade, with
//! feature `metrics`; without it, nothing (these calls compile to nothing). The
//! names, kinds and labels are listed in the `idem-axum` crate's docs, "Metrics".

use std::time::Duration;

/// One request's outcome. The label is taken by value: a replay from memory
/// builds it for this call alone.
pub(crate) fn request(outcome: &'static str, endpoint: String) {
    #[cfg(feature = "metrics")]
    metrics::counter!("idem_requests_total", "outcome" => outcome, "endpoint" => endpoint)
        .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (outcome, endpoint);
}

/// How long taking a claim took.
pub(crate) fn claimed(took: Duration, endpoint: &str) {
    #[cfg(feature = "metrics")]
    metrics::histogram!("idem_claim_duration_seconds", "endpoint" => endpoint.to_owned())
        .record(took.as_secs_f64());
    #[cfg(not(feature = "metrics"))]
    let _ = (took, endpoint);
}

/// How long recording and committing took.
pub(crate) fn recorded(took: Duration, endpoint: &str) {
    #[cfg(feature = "metrics")]
    metrics::histogram!("idem_record_duration_seconds", "endpoint" => endpoint.to_owned())
        .record(took.as_secs_f64());
    #[cfg(not(feature = "metrics"))]
    let _ = (took, endpoint);
}

/// A record in plain text replayed by a store that has a key ring (turning
/// sealing on or off): each is counted, so that an operator sees when none are
/// left before the next step, and sees one that should not be there.
pub(crate) fn plain_replayed() {
    #[cfg(feature = "metrics")]
    metrics::counter!("idem_plain_replays_total").increment(1);
}

/// Rows the sweeper deleted.
pub(crate) fn swept(rows: u64) {
    #[cfg(feature = "metrics")]
    metrics::counter!("idem_sweep_deleted_total").increment(rows);
    #[cfg(not(feature = "metrics"))]
    let _ = rows;
}

/// A claim held by this process, counted in `idem_claims_in_flight` until dropped.
pub(crate) struct Held(());

impl Held {
    pub(crate) fn new() -> Self {
        #[cfg(feature = "metrics")]
        metrics::gauge!("idem_claims_in_flight").increment(1.0);
        Self(())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        #[cfg(feature = "metrics")]
        metrics::gauge!("idem_claims_in_flight").decrement(1.0);
    }
}
