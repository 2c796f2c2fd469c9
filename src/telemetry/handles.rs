//! Metric handles kept per label set, so the request path does not rebuild metric keys.
//!
//! `metrics::counter!(name, labels)` allocates its label strings, builds a key and looks it up
//! in the recorder's registry on every call: about a thousand instructions each, and a request
//! records a dozen metrics. A [`LabelCache`] maps a label set, looked up by borrowed `&str`s
//! without allocating, to the handles made for it the first time — or to any other
//! cheap-to-clone value derived from labels only (the limiter's check ids, for one).
//!
//! Reads are a lock-free snapshot load ([`arc_swap`]); a new label set copies the map once
//! (copy-on-write), which is cheap because label sets are few and stable.
//!
//! Invariants:
//! - Label values come from bounded sets (configured keys, tenants, models and backends, and
//!   fixed labels), never from raw client input, so the map stays as small as the registry.
//! - Through [`LabelCache::handles`], metric handles are kept only once the process's recorder
//!   is installed ([`super::metrics::recorder_installed`]); before that, `make` runs on every
//!   call, so a handle made without a recorder (a no-op) is never kept.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use arc_swap::ArcSwap;
use hashbrown::{Equivalent, HashMap};

/// Values by label set of `N` labels.
pub struct LabelCache<const N: usize, V> {
    map: ArcSwap<HashMap<Owned<N>, V>>,
}

/// A label set as stored.
#[derive(Clone, PartialEq, Eq)]
struct Owned<const N: usize>([Box<str>; N]);

impl<const N: usize> Hash for Owned<N> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        for label in &self.0 {
            state.write(label.as_bytes());
            state.write_u8(0xff); // not UTF-8: separates ("ab", "c") from ("a", "bc")
        }
    }
}

/// A label set as looked up (borrowed; hashes exactly like [`Owned`]).
struct Borrowed<'a, const N: usize>(&'a [&'a str; N]);

impl<const N: usize> Hash for Borrowed<'_, N> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        for label in self.0 {
            state.write(label.as_bytes());
            state.write_u8(0xff);
        }
    }
}

impl<const N: usize> Equivalent<Owned<N>> for Borrowed<'_, N> {
    fn equivalent(&self, key: &Owned<N>) -> bool {
        self.0.iter().zip(key.0.iter()).all(|(a, b)| *a == &**b)
    }
}

impl<const N: usize, V: Clone> Default for LabelCache<N, V> {
    fn default() -> Self {
        LabelCache {
            map: ArcSwap::from_pointee(HashMap::new()),
        }
    }
}

impl<const N: usize, V: Clone> LabelCache<N, V> {
    /// The value for `labels`, made by `make` the first time they are seen.
    pub fn get(&self, labels: [&str; N], make: impl FnOnce() -> V) -> V {
        if let Some(v) = self.map.load().get(&Borrowed(&labels)) {
            return v.clone();
        }
        self.insert(labels, make())
    }

    /// Like [`get`](Self::get) for values holding metric handles: kept only once the recorder
    /// is installed.
    pub fn handles(&self, labels: [&str; N], make: impl FnOnce() -> V) -> V {
        if !super::metrics::recorder_installed() {
            return make();
        }
        self.get(labels, make)
    }

    /// Keep `made` for `labels` (or the value a concurrent caller kept first) and return it.
    fn insert(&self, labels: [&str; N], made: V) -> V {
        let key = Owned(labels.map(Box::from));
        let mut kept = None;
        self.map.rcu(|current| {
            let mut next = HashMap::clone(current);
            let v = next.entry(key.clone()).or_insert_with(|| made.clone());
            kept = Some(v.clone());
            Arc::new(next)
        });
        kept.unwrap_or(made)
    }

    /// Every label set seen so far with its value.
    pub fn snapshot(&self) -> Vec<([String; N], V)> {
        self.map
            .load()
            .iter()
            .map(|(k, v)| (k.0.clone().map(String::from), v.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn installed() -> LabelCache<2, Arc<AtomicU32>> {
        let _ = super::super::metrics::handle();
        LabelCache::default()
    }

    #[test]
    fn a_label_set_is_made_once_and_shared() {
        let cache = installed();
        let made = AtomicU32::new(0);
        let make = || {
            made.fetch_add(1, Ordering::Relaxed);
            Arc::new(AtomicU32::new(0))
        };
        cache
            .get(["gpu-1", "2xx"], make)
            .fetch_add(1, Ordering::Relaxed);
        cache
            .get(["gpu-1", "2xx"], make)
            .fetch_add(1, Ordering::Relaxed);
        cache
            .get(["gpu-1", "5xx"], make)
            .fetch_add(1, Ordering::Relaxed);
        assert_eq!(made.load(Ordering::Relaxed), 2);
        let mut all = cache.snapshot();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(all.len(), 2);
        assert_eq!(all[0].0, ["gpu-1".to_string(), "2xx".to_string()]);
        assert_eq!(all[0].1.load(Ordering::Relaxed), 2);
        assert_eq!(all[1].1.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn labels_are_not_confused_by_where_they_split() {
        let cache = installed();
        cache.get(["ab", "c"], || Arc::new(AtomicU32::new(1)));
        let v = cache.get(["a", "bc"], || Arc::new(AtomicU32::new(2)));
        assert_eq!(v.load(Ordering::Relaxed), 2);
        assert_eq!(cache.snapshot().len(), 2);
    }

    #[test]
    fn concurrent_first_uses_keep_one_value() {
        let cache = Arc::new(installed());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let cache = cache.clone();
                std::thread::spawn(move || {
                    for i in 0..200u32 {
                        let name = format!("b{}", i % 10);
                        cache
                            .get([name.as_str(), "x"], || Arc::new(AtomicU32::new(0)))
                            .fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let all = cache.snapshot();
        assert_eq!(all.len(), 10);
        let total: u32 = all.iter().map(|(_, v)| v.load(Ordering::Relaxed)).sum();
        assert_eq!(total, 800, "every increment landed on the kept value");
    }
}
