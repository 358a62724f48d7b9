//! Completed responses kept in process, so that retries of a completed key are
//! answered without the database (`docs/contract.md` §6, "Replays from memory").
//!
//! A completed record never changes until its key expires or an operator deletes
//! it, so a copy is exact for as long as it is kept, within two bounds: never past
//! the key's expiry (a retry after it must run again), and never longer than the
//! store's `replay_cache_refresh` (how long an operator's deletion may go unseen
//! by this process). Only committed records enter: one this process just
//! committed, or one it read from the table. And a copy is trusted only while the
//! database has not failed since it was read: a failover to a replica that had
//! not received a commit loses the row, and the retry must then run again, as it
//! would without the cache.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use quick_cache::sync::{Cache, DefaultLifecycle, PlaceholderGuard};
use quick_cache::{DefaultHashBuilder, OptionsBuilder, Weighter};

use crate::backend::Found;

/// Bytes an entry costs beyond its strings and payload: the record's fixed fields
/// and the `Arc` around them, the cache's slot for it (key, pointer, metadata, its
/// share of the table and of the ghosts of evicted keys), and the header its body
/// gets when a replay first shares it. Measured by `tests/cache_memory.rs`, which
/// holds the whole cache to 1.1× its bound (it finds 0.90–0.94); about 380 bytes.
const ENTRY_OVERHEAD: u64 = (std::mem::size_of::<Entry>() + 16 + 160) as u64;

/// The cache's shards, whatever the host's cores (the cache crate's default is four
/// per core): an entry heavier than what one shard keeps hot is never kept, so the
/// largest response kept would otherwise shrink as cores grow (31 KiB of the
/// default 8 MiB on 64 cores). Eight keep it near the default `max_response_bytes`.
const SHARDS: usize = 8;

/// The share of a shard an entry may weigh (the cache crate's hot allocation).
const HOT_SHARE: f64 = 0.97;

/// How long a request waits for another one of this process to look its key up
/// (a statement, usually milliseconds) before it looks on its own: a holder stuck
/// waiting for a pooled connection must not queue its duplicates one by one.
const FILLER_PATIENCE: Duration = Duration::from_secs(1);

/// `found` with every buffer exactly its length: an entry weighs what it holds. A
/// body is often a slice of a larger buffer (a serializer's grown `Vec`, a reused
/// write buffer), which a kept slice would keep whole.
fn compact(mut found: Found) -> Found {
    found.method.shrink_to_fit();
    found.path.shrink_to_fit();
    if let Some(content_type) = &mut found.content_type {
        content_type.shrink_to_fit();
    }
    found.fingerprint.shrink_to_fit();
    found.headers = found
        .headers
        .map(|headers| bytes::Bytes::copy_from_slice(&headers));
    found.body = found.body.map(|body| bytes::Bytes::copy_from_slice(&body));
    found
}

/// A completed record, and the instant after which it is no longer trusted.
#[derive(Debug)]
pub(crate) struct Entry {
    pub(crate) found: Found,
    until: Instant,
    /// The store's epoch when the record was read or claimed.
    epoch: u64,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct ByBytes;

impl Weighter<[u8; 32], Arc<Entry>> for ByBytes {
    fn weight(&self, _key: &[u8; 32], entry: &Arc<Entry>) -> u64 {
        let found = &entry.found;
        let bytes = found.method.len()
            + found.path.len()
            + found.content_type.as_ref().map_or(0, String::len)
            + found.fingerprint.len()
            + found.headers.as_ref().map_or(0, bytes::Bytes::len)
            + found.body.as_ref().map_or(0, bytes::Bytes::len);
        ENTRY_OVERHEAD + bytes as u64
    }
}

type Entries = Cache<[u8; 32], Arc<Entry>, ByBytes>;

/// Held by the one request of this process that looks a key up in the table;
/// others asking for the same key wait for it (a storm reaches the table once).
pub(crate) type Filler<'a> = PlaceholderGuard<
    'a,
    [u8; 32],
    Arc<Entry>,
    ByBytes,
    DefaultHashBuilder,
    DefaultLifecycle<[u8; 32], Arc<Entry>>,
>;

pub(crate) struct ReplayCache {
    entries: Entries,
    refresh: Duration,
    /// Counts the database's failures seen by this store; entries of an earlier
    /// count are not trusted.
    epoch: AtomicU64,
}

pub(crate) enum Looked<'a> {
    Hit(Arc<Entry>),
    /// Not kept: this request reads the table, and fills the entry if it finds the
    /// key completed. Dropping the filler lets the next request of the key look.
    /// No filler when another request held it past `FILLER_PATIENCE`.
    Miss(Option<Filler<'a>>),
}

impl ReplayCache {
    /// `None` when `max_bytes` or `refresh` is zero: no cache.
    pub(crate) fn new(max_bytes: usize, refresh: Duration) -> Option<Self> {
        if max_bytes == 0 || refresh.is_zero() {
            return None;
        }
        let max_bytes = max_bytes as u64;
        // A guess at the number of entries, for the table's initial size: small
        // JSON responses.
        let items = usize::try_from(max_bytes / 1024)
            .unwrap_or(usize::MAX)
            .max(16);
        let options = OptionsBuilder::new()
            .estimated_items_capacity(items)
            .weight_capacity(max_bytes)
            .shards(SHARDS)
            .hot_allocation(HOT_SHARE)
            .build()
            .ok()?;
        let entries = Cache::with_options(
            options,
            ByBytes,
            DefaultHashBuilder::default(),
            DefaultLifecycle::default(),
        );
        Some(Self {
            entries,
            refresh,
            epoch: AtomicU64::new(0),
        })
    }

    /// The heaviest entry a cache of `max_bytes` keeps (see [`SHARDS`]): a larger
    /// response is replayed from the table instead. Fewer shards are used when
    /// each would otherwise hold under 32 entries (the cache crate's rule), which
    /// only raises it. (Stated in `Builder::replay_cache`'s documentation.)
    #[cfg(test)]
    pub(crate) fn largest_entry(max_bytes: usize) -> u64 {
        let max_bytes = max_bytes as u64;
        let shards = SHARDS as u64;
        (max_bytes.div_ceil(shards) as f64 * HOT_SHARE) as u64
    }

    /// The entry for `digest` if one is kept and still trusted; otherwise the
    /// filler, once no other request of this process is looking the key up.
    pub(crate) async fn look(&self, digest: &[u8; 32]) -> Looked<'_> {
        let deadline = tokio::time::Instant::now() + FILLER_PATIENCE;
        loop {
            let looked =
                tokio::time::timeout_at(deadline, self.entries.get_value_or_guard_async(digest));
            match looked.await {
                Ok(Ok(entry)) if Instant::now() < entry.until && entry.epoch == self.epoch() => {
                    return Looked::Hit(entry);
                }
                Ok(Ok(stale)) => {
                    self.entries
                        .remove_if(digest, |kept| Arc::ptr_eq(kept, &stale));
                }
                Ok(Err(filler)) => return Looked::Miss(Some(filler)),
                Err(_) => return Looked::Miss(None),
            }
        }
    }

    /// The entry for `digest` if one is kept and still trusted, without waiting
    /// for a request of this process that is looking the key up.
    pub(crate) fn kept(&self, digest: &[u8; 32]) -> Option<Arc<Entry>> {
        self.entries
            .get(digest)
            .filter(|entry| Instant::now() < entry.until && entry.epoch == self.epoch())
    }

    /// The current epoch, to be read before the database is.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// The database failed: nothing kept until now is trusted any more.
    pub(crate) fn distrust(&self) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
    }

    /// Keeps `found` if it is a completed, unexpired record; `read` is an instant
    /// no later than the database's reading of it (its `ttl_left_ms`), and the
    /// epoch then. Through `filler` when this request holds it, so that waiting
    /// requests get it.
    pub(crate) fn keep(
        &self,
        digest: [u8; 32],
        found: &Found,
        read: (Instant, u64),
        filler: Option<Filler<'_>>,
    ) {
        if found.completed && found.fresh() {
            self.put(digest, found.clone(), read, filler);
        }
    }

    /// Keeps the record this process just committed (`Found::recorded`); `claimed`
    /// is an instant no later than the claim that set its expiry, and the epoch then.
    pub(crate) fn committed(&self, digest: [u8; 32], found: Found, claimed: (Instant, u64)) {
        self.put(digest, found, claimed, None);
    }

    fn put(
        &self,
        digest: [u8; 32],
        found: Found,
        (from, epoch): (Instant, u64),
        filler: Option<Filler<'_>>,
    ) {
        // The database rounds what is left up to a millisecond; a millisecond less
        // keeps the copy strictly inside the key's life.
        let left = Duration::from_millis(found.ttl_left_ms.max(0).unsigned_abs())
            .saturating_sub(Duration::from_millis(1));
        let until = from + left.min(self.refresh);
        if until <= Instant::now() || epoch != self.epoch() {
            return;
        }
        let entry = Arc::new(Entry {
            found: compact(found),
            until,
            epoch,
        });
        match filler {
            // `Err`: the placeholder was removed meanwhile (an operator's `forget`).
            Some(filler) => drop(filler.insert(entry)),
            None => self.entries.insert(digest, entry),
        }
    }

    /// Drops this process's copy of a key (an operator deleted it here).
    pub(crate) fn forget(&self, digest: &[u8; 32]) {
        self.entries.remove(digest);
    }

    /// Bytes the kept entries weigh.
    pub(crate) fn weight(&self) -> u64 {
        self.entries.weight()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn completed(body: &'static [u8], ttl_left_ms: i64) -> Found {
        Found {
            completed: true,
            live: false,
            ttl_left_ms,
            method: "POST".into(),
            path: "/payments".into(),
            content_type: Some("application/json".into()),
            fingerprint: vec![7; 32],
            status: Some(201),
            headers: Some(bytes::Bytes::from_static(b"content-type: application/json")),
            body: Some(bytes::Bytes::from_static(body)),
            unreadable: None,
        }
    }

    /// A distinct digest for each `n`.
    fn digest_of(n: u32) -> [u8; 32] {
        let mut digest = [0; 32];
        digest[..4].copy_from_slice(&n.to_be_bytes());
        digest
    }

    async fn hit(cache: &ReplayCache, digest: &[u8; 32]) -> Option<Arc<Entry>> {
        match cache.look(digest).await {
            Looked::Hit(entry) => Some(entry),
            Looked::Miss(_) => None,
        }
    }

    #[tokio::test]
    async fn kept_until_the_key_expires_or_the_refresh_passes() {
        let cache = ReplayCache::new(1 << 20, Duration::from_millis(200)).expect("a cache");
        let now = Instant::now();
        // Expires in 50 ms: kept 49 ms, not the 200 ms refresh.
        cache.committed([1; 32], completed(b"{}", 50), (now, 0));
        assert!(hit(&cache, &[1; 32]).await.is_some());
        // A record read with 10 s left: kept for the refresh only.
        cache.keep([2; 32], &completed(b"{}", 10_000), (now, 0), None);
        assert!(hit(&cache, &[2; 32]).await.is_some());
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert!(
            hit(&cache, &[1; 32]).await.is_none(),
            "past the key's expiry"
        );
        assert!(hit(&cache, &[2; 32]).await.is_some());
        tokio::time::sleep(Duration::from_millis(160)).await;
        assert!(hit(&cache, &[2; 32]).await.is_none(), "past the refresh");
    }

    #[tokio::test]
    async fn only_completed_unexpired_records_are_kept() {
        let cache = ReplayCache::new(1 << 20, Duration::from_secs(30)).expect("a cache");
        let now = Instant::now();
        cache.keep([1; 32], &completed(b"{}", 0), (now, 0), None);
        assert!(hit(&cache, &[1; 32]).await.is_none(), "expired");
        let mut claim = completed(b"{}", 10_000);
        claim.completed = false;
        cache.keep([2; 32], &claim, (now, 0), None);
        assert!(hit(&cache, &[2; 32]).await.is_none(), "in flight");
        assert_eq!(cache.weight(), 0);
    }

    #[tokio::test]
    async fn waiting_lookups_get_what_the_filler_keeps() {
        let cache = Arc::new(ReplayCache::new(1 << 20, Duration::from_secs(30)).expect("a cache"));
        let Looked::Miss(Some(filler)) = cache.look(&[3; 32]).await else {
            panic!("an empty cache has nothing");
        };
        let waiter = tokio::spawn({
            let cache = Arc::clone(&cache);
            async move { hit(&cache, &[3; 32]).await.is_some() }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "waits for the filler");
        cache.keep(
            [3; 32],
            &completed(b"{}", 10_000),
            (Instant::now(), 0),
            Some(filler),
        );
        assert!(waiter.await.expect("joined"), "got the kept entry");
    }

    #[tokio::test]
    async fn a_failed_database_ends_every_copy() {
        let cache = ReplayCache::new(1 << 20, Duration::from_secs(30)).expect("a cache");
        let before = (Instant::now(), cache.epoch());
        cache.keep([1; 32], &completed(b"{}", 10_000), before, None);
        assert!(hit(&cache, &[1; 32]).await.is_some());
        cache.distrust();
        assert!(
            hit(&cache, &[1; 32]).await.is_none(),
            "read before the failure"
        );
        // A read that began before the failure and ends after it is not kept.
        cache.keep([2; 32], &completed(b"{}", 10_000), before, None);
        assert!(hit(&cache, &[2; 32]).await.is_none());
        let after = (Instant::now(), cache.epoch());
        cache.keep([2; 32], &completed(b"{}", 10_000), after, None);
        assert!(hit(&cache, &[2; 32]).await.is_some());
    }

    #[tokio::test]
    async fn a_stuck_filler_is_not_waited_for_long() {
        let cache = ReplayCache::new(1 << 20, Duration::from_secs(30)).expect("a cache");
        let Looked::Miss(Some(_held)) = cache.look(&[4; 32]).await else {
            panic!("an empty cache has nothing");
        };
        let Looked::Miss(None) = cache.look(&[4; 32]).await else {
            panic!("no entry, and the filler is held");
        };
    }

    #[test]
    fn bounded_in_bytes() {
        let cache = ReplayCache::new(64 * 1024, Duration::from_secs(30)).expect("a cache");
        let body = &[b'x'; 1000];
        for n in 0..1000 {
            let found = Found {
                body: Some(bytes::Bytes::copy_from_slice(body)),
                ..completed(b"", 10_000)
            };
            cache.committed(digest_of(n), found, (Instant::now(), 0));
        }
        assert!(cache.weight() <= 64 * 1024, "{} bytes", cache.weight());
        assert!(cache.weight() > 16 * 1024, "{} bytes", cache.weight());
    }

    /// The largest entry kept is the one stated, whatever the host's cores: the
    /// shard count is set, not taken from the cores.
    #[tokio::test]
    async fn the_largest_entry_kept_does_not_depend_on_cores() {
        let bound = 8 * 1024 * 1024;
        let largest = ReplayCache::largest_entry(bound);
        assert_eq!(largest, 1_017_118, "97% of an eighth of 8 MiB");
        let cache = ReplayCache::new(bound, Duration::from_secs(30)).expect("a cache");
        let weighing = |body_len: u64| {
            let found = completed(b"", 10_000);
            let entry = Entry {
                found,
                until: Instant::now(),
                epoch: 0,
            };
            ByBytes.weight(&[0; 32], &Arc::new(entry)) + body_len
        };
        let fits = usize::try_from(largest - weighing(0)).expect("fits");
        for (n, len, kept) in [(1u8, fits, true), (2, fits + 1, false)] {
            let found = Found {
                body: Some(bytes::Bytes::from(vec![b'x'; len])),
                ..completed(b"", 10_000)
            };
            cache.committed([n; 32], found, (Instant::now(), 0));
            assert_eq!(hit(&cache, &[n; 32]).await.is_some(), kept, "{len} bytes");
        }
    }

    /// Entries of nearly a shard each are kept one per shard, whichever way they
    /// come in: committed here, or read from the table by a filler.
    #[tokio::test]
    async fn heavy_entries_are_kept_one_per_shard() {
        for through_filler in [false, true] {
            let cache = ReplayCache::new(512 * 1024, Duration::from_secs(30)).expect("a cache");
            for n in 0..200 {
                let digest = digest_of(n);
                let found = Found {
                    body: Some(bytes::Bytes::from(vec![b'x'; 60 * 1024])),
                    ..completed(b"", 10_000)
                };
                if through_filler {
                    let Looked::Miss(Some(filler)) = cache.look(&digest).await else {
                        panic!("{n}: a new key has no entry");
                    };
                    cache.keep(digest, &found, (Instant::now(), 0), Some(filler));
                } else {
                    cache.committed(digest, found, (Instant::now(), 0));
                }
            }
            assert_eq!(
                cache.entries.len(),
                SHARDS,
                "through a filler: {through_filler}"
            );
            assert!(cache.weight() > 480 * 1024, "{} bytes", cache.weight());
        }
    }

    #[test]
    fn zero_turns_it_off() {
        assert!(ReplayCache::new(0, Duration::from_secs(30)).is_none());
        assert!(ReplayCache::new(1 << 20, Duration::ZERO).is_none());
    }
}
