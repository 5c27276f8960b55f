//! The one renderer of `/metrics`: every component's metrics, encoded by `prometheus-client`.
//!
//! # Contract
//! - Each component keeps its own state (atomics, so that the packet path stays lock-free and
//!   allocates nothing) and implements `prometheus-client`'s [`Collector`] over it: at scrape
//!   time it reads its atomics and feeds the values into `ConstCounter`s and `ConstGauge`s
//!   through the helpers here ([`counter`], [`gauge`], [`counter_family`], [`gauge_family`]).
//!   The route watcher's [`crate::route::watcher::RouteStats`], the data plane's
//!   [`crate::dataplane::worker::counters::Counters`] and [`crate::dataplane::worker::supervise::WorkerStates`],
//!   and the lease metrics in [`crate::health`] do.
//! - [`render`] builds a [`Registry`] of the collectors it is given, in that order, at scrape
//!   time, and encodes it in the Prometheus text format 0.0.4 ([`CONTENT_TYPE`]), the format
//!   `/metrics` has always served: scrapers, `scripts/` and the tests read lines
//!   `name{labels} value`, and the `# HELP`/`# TYPE` lines name the same metric as its samples.
//!   (The OpenMetrics encoder would name a counter's family without `_total` in `# TYPE` and end
//!   with `# EOF`; nothing weft serves is OpenMetrics.)
//! - Names stay as they were: every counter's name ends in `_total`, and `prometheus-client`
//!   adds that suffix to every counter it encodes, so [`counter`] and [`counter_family`] take
//!   the full name (the one to grep for) and hand the encoder the name without it.
//! - Help texts are written as given (a [`Collector`]'s help is not changed by the registry).

use std::fmt;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeGaugeValue, EncodeLabelSet, EncodeMetric, prometheus_text,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

/// The `Content-Type` of what [`render`] returns (Prometheus text format 0.0.4).
pub(crate) const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// The encoder failed: only a collector that returns an error of its own can make it fail, as
/// writing to a `String` cannot.
#[derive(Debug, thiserror::Error)]
#[error("encoding the metrics failed")]
pub struct RenderError(#[from] fmt::Error);

/// A collector shared with the component that owns its state.
#[derive(Debug)]
struct Shared(Arc<dyn Collector>);

impl Collector for Shared {
    fn encode(&self, encoder: DescriptorEncoder<'_>) -> fmt::Result {
        self.0.encode(encoder)
    }
}

/// The Prometheus text exposition of `collectors`, in their order.
pub(crate) fn render(collectors: &[Arc<dyn Collector>]) -> Result<String, RenderError> {
    let mut registry = Registry::default();
    for collector in collectors {
        registry.register_collector(Box::new(Shared(collector.clone())));
    }
    let mut out = String::new();
    prometheus_text::encode(&mut out, &registry)?;
    Ok(out)
}

/// The Prometheus text exposition of one collector.
pub fn render_collector(collector: Arc<dyn Collector>) -> Result<String, RenderError> {
    render(&[collector])
}

/// The name `prometheus-client` is given for a counter: `name` without the `_total` it adds.
fn counter_base(name: &str) -> &str {
    name.strip_suffix("_total").unwrap_or(name)
}

/// One counter without labels, `name` ending in `_total`.
pub(crate) fn counter(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    value: u64,
) -> fmt::Result {
    let metric = ConstCounter::new(value);
    metric.encode(encoder.encode_descriptor(
        counter_base(name),
        help,
        None,
        metric.metric_type(),
    )?)
}

/// One gauge without labels.
pub(crate) fn gauge<V: EncodeGaugeValue>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    value: V,
) -> fmt::Result {
    let metric = ConstGauge::new(value);
    metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
}

/// A counter with labels, `name` ending in `_total`: one sample per `(labels, value)`, in
/// order (none: only the `# HELP` and `# TYPE` lines).
pub(crate) fn counter_family<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (L, u64)>,
) -> fmt::Result {
    let mut family =
        encoder.encode_descriptor(counter_base(name), help, None, MetricType::Counter)?;
    for (labels, value) in samples {
        ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// A gauge with labels: one sample per `(labels, value)`, in order.
pub(crate) fn gauge_family<L: EncodeLabelSet, V: EncodeGaugeValue>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (L, V)>,
) -> fmt::Result {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, value) in samples {
        ConstGauge::new(value).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One of each kind, as a component would write them.
    #[derive(Debug)]
    struct Example;

    impl Collector for Example {
        fn encode(&self, mut e: DescriptorEncoder<'_>) -> fmt::Result {
            counter(&mut e, "weft_example_things_total", "Things counted.", 3)?;
            gauge(&mut e, "weft_example_level", "A level.", 7u64)?;
            gauge(&mut e, "weft_example_seconds", "Seconds left.", -1.25f64)?;
            counter_family(
                &mut e,
                "weft_example_drops_total",
                "Drops, by direction and reason.",
                [
                    ([("dir", "rx"), ("reason", "wrong_vni")], 2),
                    ([("dir", "tx"), ("reason", "x")], 0),
                ],
            )?;
            gauge_family(&mut e, "weft_example_up", "Up.", [([("thread", "q0")], 1u64)])?;
            counter_family::<[(&str, &str); 1]>(&mut e, "weft_example_none_total", "None.", [])
        }
    }

    #[test]
    fn names_types_and_samples_are_prometheus_text_with_total_never_doubled() {
        let text = render(&[Arc::new(Example)]).unwrap();
        assert_eq!(
            text,
            "# HELP weft_example_things_total Things counted.\n\
             # TYPE weft_example_things_total counter\n\
             weft_example_things_total 3\n\
             # HELP weft_example_level A level.\n\
             # TYPE weft_example_level gauge\n\
             weft_example_level 7\n\
             # HELP weft_example_seconds Seconds left.\n\
             # TYPE weft_example_seconds gauge\n\
             weft_example_seconds -1.25\n\
             # HELP weft_example_drops_total Drops, by direction and reason.\n\
             # TYPE weft_example_drops_total counter\n\
             weft_example_drops_total{dir=\"rx\",reason=\"wrong_vni\"} 2\n\
             weft_example_drops_total{dir=\"tx\",reason=\"x\"} 0\n\
             # HELP weft_example_up Up.\n\
             # TYPE weft_example_up gauge\n\
             weft_example_up{thread=\"q0\"} 1\n\
             # HELP weft_example_none_total None.\n\
             # TYPE weft_example_none_total counter\n"
        );
    }

    #[test]
    fn collectors_are_rendered_in_the_order_given() {
        #[derive(Debug)]
        struct One(&'static str);
        impl Collector for One {
            fn encode(&self, mut e: DescriptorEncoder<'_>) -> fmt::Result {
                gauge(&mut e, self.0, "One.", 1u64)
            }
        }
        let text = render(&[Arc::new(One("weft_b")), Arc::new(One("weft_a"))]).unwrap();
        let samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(samples, ["weft_b 1", "weft_a 1"]);
    }
}
