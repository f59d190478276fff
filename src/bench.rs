//! The load generator: submits chat jobs at a fixed concurrency and reports
//! throughput and end-to-end latency (`toolfleet bench`). Figures in
//! BENCHMARKS.md come from here, never from timed assertions in tests.

use std::time::{Duration, Instant};

use futures::StreamExt;

use toolfleet_protocol::{ChatEventBody, Subjects};

/// What a run measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchReport {
    pub jobs: usize,
    pub concurrency: usize,
    pub completed: usize,
    pub failed: usize,
    pub tool_calls: usize,
    pub elapsed_secs: f64,
    pub jobs_per_sec: f64,
    pub tool_calls_per_sec: f64,
    pub latency_ms_p50: f64,
    pub latency_ms_p95: f64,
    pub latency_ms_p99: f64,
    pub latency_ms_max: f64,
    /// Peak resident memory of this process (the whole in-process fleet when
    /// run by `toolfleet bench`), from `/proc/self/status`.
    pub peak_rss_mib: Option<f64>,
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "jobs {} (concurrency {}): {} completed, {} failed",
            self.jobs, self.concurrency, self.completed, self.failed
        )?;
        writeln!(
            f,
            "elapsed {:.2} s: {:.1} jobs/s, {:.1} tool calls/s",
            self.elapsed_secs, self.jobs_per_sec, self.tool_calls_per_sec
        )?;
        writeln!(
            f,
            "latency ms: p50 {:.1}  p95 {:.1}  p99 {:.1}  max {:.1}",
            self.latency_ms_p50, self.latency_ms_p95, self.latency_ms_p99, self.latency_ms_max
        )?;
        if let Some(rss) = self.peak_rss_mib {
            writeln!(f, "peak RSS {rss:.1} MiB")?;
        }
        Ok(())
    }
}

pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// Peak resident set size of this process, in MiB (Linux only).
pub fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// Submits `jobs` chat jobs asking `questions` in turn, `concurrency` at a
/// time, and waits for each terminal event.
pub async fn run(
    client: &async_nats::Client,
    subjects: &Subjects,
    questions: &[String],
    jobs: usize,
    concurrency: usize,
    timeout: Duration,
    slow: Duration,
) -> BenchReport {
    let started = Instant::now();
    let results: Vec<(bool, usize, f64)> = futures::stream::iter(0..jobs)
        .map(|i| {
            let q = &questions[i % questions.len().max(1)];
            async move {
                let job = toolfleet_protocol::client::question(q);
                let t = Instant::now();
                let mut tools = 0;
                let mut timeline = Vec::new();
                let r = toolfleet_protocol::client::chat(client, subjects, &job, timeout, |e| {
                    timeline.push((t.elapsed().as_millis(), ChatEventBody::name(&e.body)));
                    if matches!(e.body, ChatEventBody::ToolResult { .. }) {
                        tools += 1;
                    }
                })
                .await;
                // An outlier is worth its story: when each event arrived.
                if t.elapsed() > slow {
                    eprintln!(
                        "slow job {} ({} ms): {timeline:?}",
                        job.invocation_id,
                        t.elapsed().as_millis()
                    );
                }
                (r.is_ok(), tools, t.elapsed().as_secs_f64() * 1000.0)
            }
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await;
    let elapsed = started.elapsed().as_secs_f64();
    let mut latencies: Vec<f64> = results.iter().map(|r| r.2).collect();
    latencies.sort_by(|a, b| a.total_cmp(b));
    let completed = results.iter().filter(|r| r.0).count();
    let tool_calls: usize = results.iter().map(|r| r.1).sum();
    BenchReport {
        jobs,
        concurrency,
        completed,
        failed: jobs - completed,
        tool_calls,
        elapsed_secs: elapsed,
        jobs_per_sec: completed as f64 / elapsed.max(f64::EPSILON),
        tool_calls_per_sec: tool_calls as f64 / elapsed.max(f64::EPSILON),
        latency_ms_p50: percentile(&latencies, 50.0),
        latency_ms_p95: percentile(&latencies, 95.0),
        latency_ms_p99: percentile(&latencies, 99.0),
        latency_ms_max: latencies.last().copied().unwrap_or(0.0),
        peak_rss_mib: peak_rss_mib(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_pick_ranks() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 51.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }
}
