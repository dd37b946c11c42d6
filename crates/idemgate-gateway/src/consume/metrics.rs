//! The consumer's series, one set per source, on the admin listener's `/metrics` beside the
//! gateway's own.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::source::Backlog;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabels {
    source: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeadLabels {
    source: String,
    reason: &'static str,
}

/// Every source's series.
#[derive(Clone, Debug, Default)]
pub struct ConsumerMetrics {
    delivered: Family<SourceLabels, Counter>,
    replayed: Family<SourceLabels, Counter>,
    retried: Family<SourceLabels, Counter>,
    dead_lettered: Family<DeadLabels, Counter>,
    in_flight: Family<SourceLabels, Gauge>,
    pending: Family<SourceLabels, Gauge>,
    lag: Family<SourceLabels, Gauge>,
}

impl ConsumerMetrics {
    /// Registers the series in `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "idemgate_consumer_delivered",
            "Messages the handler ran for and whose response was kept, acknowledged",
            self.delivered.clone(),
        );
        registry.register(
            "idemgate_consumer_replayed",
            "Messages answered from a kept response (a duplicate, or a redelivery after a crash), acknowledged; the handler did not run",
            self.replayed.clone(),
        );
        registry.register(
            "idemgate_consumer_retries",
            "Tries the handler refused with a status the route does not keep, or did not get, and that are tried again",
            self.retried.clone(),
        );
        registry.register(
            "idemgate_consumer_dead_lettered",
            "Messages written to the dead-letter stream and acknowledged, by reason",
            self.dead_lettered.clone(),
        );
        registry.register(
            "idemgate_consumer_in_flight",
            "Messages this consumer is delivering now",
            self.in_flight.clone(),
        );
        registry.register(
            "idemgate_consumer_pending",
            "Messages delivered to the group's consumers and not yet acknowledged",
            self.pending.clone(),
        );
        registry.register(
            "idemgate_consumer_lag",
            "Messages in the stream not yet delivered to the group",
            self.lag.clone(),
        );
    }

    /// The handles for `source`.
    pub fn source(&self, source: &str) -> SourceMetrics {
        let labels = SourceLabels {
            source: source.to_owned(),
        };
        SourceMetrics {
            name: source.to_owned(),
            delivered: self.delivered.get_or_create(&labels).clone(),
            replayed: self.replayed.get_or_create(&labels).clone(),
            retried: self.retried.get_or_create(&labels).clone(),
            dead_lettered: self.dead_lettered.clone(),
            in_flight: self.in_flight.get_or_create(&labels).clone(),
            pending: self.pending.get_or_create(&labels).clone(),
            lag: self.lag.get_or_create(&labels).clone(),
        }
    }
}

/// One source's series.
#[derive(Clone, Debug)]
pub struct SourceMetrics {
    name: String,
    delivered: Counter,
    replayed: Counter,
    retried: Counter,
    dead_lettered: Family<DeadLabels, Counter>,
    in_flight: Gauge,
    pending: Gauge,
    lag: Gauge,
}

impl SourceMetrics {
    /// A message settled: run now, or answered from its record.
    pub fn settled(&self, replayed: bool) {
        if replayed {
            self.replayed.inc();
        } else {
            self.delivered.inc();
        }
    }

    /// A try to be made again.
    pub fn retried(&self) {
        self.retried.inc();
    }

    /// A message dead-lettered for `reason`.
    pub fn dead_lettered(&self, reason: &'static str) {
        self.dead_lettered
            .get_or_create(&DeadLabels {
                source: self.name.clone(),
                reason,
            })
            .inc();
    }

    /// Messages being delivered now.
    pub fn set_in_flight(&self, n: usize) {
        self.in_flight.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// The group's backlog, as last read.
    pub fn set_backlog(&self, backlog: Backlog) {
        self.pending
            .set(i64::try_from(backlog.pending).unwrap_or(i64::MAX));
        if let Some(lag) = backlog.lag {
            self.lag.set(i64::try_from(lag).unwrap_or(i64::MAX));
        }
    }
}
