//! The latency chart of `toolfleet bench --svg PATH`: the cumulative
//! distribution of each run's latencies (the fleet's and its floors') on a
//! logarithmic time axis, hand-written SVG text with no dependency. On one
//! chart the gap between the fleet's curve and the floor's is the overhead
//! the ratios summarise, at every percentile rather than three.

use std::fmt::Write;

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 440.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 24.0;
const TOP: f64 = 48.0;
const BOTTOM: f64 = 120.0;
/// Points drawn per curve at most: enough for a smooth line, small files.
const MAX_POINTS: usize = 400;
const COLOURS: [&str; 6] = [
    "#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
];

/// One curve: a name and its latencies in milliseconds, sorted ascending.
pub struct Series<'a> {
    pub name: &'a str,
    pub sorted_ms: &'a [f64],
}

/// An SVG document plotting, for each series, the share of operations
/// (y, 0–100 %) that took at most x milliseconds (log scale), with the
/// p50 and p99 of each marked and named in the legend.
pub fn latency_cdf(title: &str, series: &[Series<'_>]) -> String {
    let mut chart = Chart::new(series);
    chart.frame(title);
    chart.grid();
    for (i, s) in series.iter().enumerate() {
        chart.curve(i, s);
    }
    chart.svg.push_str("</svg>\n");
    chart.svg
}

/// The plot area's width and height.
const PLOT_W: f64 = WIDTH - LEFT - RIGHT;
const PLOT_H: f64 = HEIGHT - TOP - BOTTOM;

/// A chart being drawn: its SVG text so far and its time axis, from
/// 10^`lo_exp` to 10^`hi_exp` ms.
struct Chart {
    svg: String,
    lo_exp: i32,
    hi_exp: i32,
}

impl Chart {
    /// An empty chart whose time axis spans the decades of `series`.
    fn new(series: &[Series<'_>]) -> Self {
        let values = || {
            series
                .iter()
                .flat_map(|s| s.sorted_ms.iter().copied())
                .filter(|v| v.is_finite() && *v > 0.0)
        };
        let lo = values().fold(f64::INFINITY, f64::min);
        let hi = values().fold(0.0, f64::max);
        let (lo_exp, hi_exp) = if lo.is_finite() && hi > 0.0 {
            let lo_exp = lo.log10().floor() as i32;
            (lo_exp, (hi.log10().ceil() as i32).max(lo_exp + 1))
        } else {
            (-1, 3)
        };
        Self {
            svg: String::new(),
            lo_exp,
            hi_exp,
        }
    }

    /// Where `ms` falls on the (log) time axis.
    fn x_of(&self, ms: f64) -> f64 {
        let ms = ms.max(10f64.powi(self.lo_exp));
        LEFT + (ms.log10() - f64::from(self.lo_exp)) / f64::from(self.hi_exp - self.lo_exp) * PLOT_W
    }

    /// Where a share of operations (0–1) falls on the vertical axis.
    fn y_of(share: f64) -> f64 {
        TOP + (1.0 - share) * PLOT_H
    }

    /// The document's opening, background, title and axis names.
    fn frame(&mut self, title: &str) {
        let svg = &mut self.svg;
        let _ = writeln!(
            svg,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(
            svg,
            r#"<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#
        );
        let _ = writeln!(
            svg,
            r#"<text x="{LEFT}" y="24" font-size="15" font-weight="bold">{}</text>"#,
            escape(title)
        );
    }

    /// Grid: decades with 2 and 5 between them; every 10 % of operations;
    /// then the axes' names.
    fn grid(&mut self) {
        for exp in self.lo_exp..=self.hi_exp {
            for (m, major) in [(1.0, true), (2.0, false), (5.0, false)] {
                let ms = m * 10f64.powi(exp);
                if exp == self.hi_exp && !major {
                    continue;
                }
                let x = self.x_of(ms);
                let stroke = if major { "#bbb" } else { "#e6e6e6" };
                let _ = writeln!(
                    self.svg,
                    r#"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="{stroke}"/>"#,
                    TOP + PLOT_H
                );
                let _ = writeln!(
                    self.svg,
                    r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle" fill="{}">{}</text>"#,
                    TOP + PLOT_H + 16.0,
                    if major { "#333" } else { "#999" },
                    ms_label(ms)
                );
            }
        }
        for tenth in 0..=10 {
            let y = Self::y_of(f64::from(tenth) / 10.0);
            let _ = writeln!(
                self.svg,
                r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{}"/>"##,
                LEFT + PLOT_W,
                if tenth % 5 == 0 { "#bbb" } else { "#eee" }
            );
            let _ = writeln!(
                self.svg,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}%</text>"#,
                LEFT - 6.0,
                y + 4.0,
                tenth * 10
            );
        }
        let _ = writeln!(
            self.svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">latency, ms (log scale)</text>"#,
            LEFT + PLOT_W / 2.0,
            TOP + PLOT_H + 34.0
        );
        let _ = writeln!(
            self.svg,
            r#"<text transform="translate(16 {:.1}) rotate(-90)" text-anchor="middle">operations at most this slow</text>"#,
            TOP + PLOT_H / 2.0
        );
    }

    /// Series `i`: its curve with its p50 and p99 marked, and its line of
    /// the legend.
    fn curve(&mut self, i: usize, s: &Series<'_>) {
        let colour = COLOURS[i % COLOURS.len()];
        let n = s.sorted_ms.len();
        if n > 0 {
            let mut points = String::new();
            for k in sample_indices(n) {
                let share = (k + 1) as f64 / n as f64;
                let _ = write!(
                    points,
                    "{:.1},{:.1} ",
                    self.x_of(s.sorted_ms[k]),
                    Self::y_of(share)
                );
            }
            let _ = writeln!(
                self.svg,
                r#"<polyline fill="none" stroke="{colour}" stroke-width="2" points="{}"/>"#,
                points.trim_end()
            );
            for p in [50.0, 99.0] {
                let v = crate::bench::percentile(s.sorted_ms, p);
                let _ = writeln!(
                    self.svg,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{colour}"/>"#,
                    self.x_of(v),
                    Self::y_of(p / 100.0)
                );
            }
        }
        let y = HEIGHT - BOTTOM + 56.0 + 18.0 * i as f64;
        let _ = writeln!(
            self.svg,
            r#"<line x1="{LEFT}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{colour}" stroke-width="3"/>"#,
            y - 4.0,
            LEFT + 24.0,
            y - 4.0
        );
        let stats = if n == 0 {
            "no samples".to_string()
        } else {
            format!(
                "p50 {} ms, p99 {} ms, n = {n}",
                ms_label(crate::bench::percentile(s.sorted_ms, 50.0)),
                ms_label(crate::bench::percentile(s.sorted_ms, 99.0))
            )
        };
        let _ = writeln!(
            self.svg,
            r#"<text x="{:.1}" y="{y:.1}">{} — {stats}</text>"#,
            LEFT + 32.0,
            escape(s.name)
        );
    }
}

/// At most [`MAX_POINTS`] indices spread over `0..n`, always with the
/// first and the last (the tail is where the story often is).
fn sample_indices(n: usize) -> Vec<usize> {
    if n <= MAX_POINTS {
        return (0..n).collect();
    }
    let mut v: Vec<usize> = (0..MAX_POINTS)
        .map(|k| k * (n - 1) / (MAX_POINTS - 1))
        .collect();
    v.dedup();
    v
}

/// `0.25`, `2`, `1500` — short labels for milliseconds.
fn ms_label(ms: f64) -> String {
    if ms >= 10.0 {
        format!("{ms:.0}")
    } else if ms >= 1.0 {
        let s = format!("{ms:.1}");
        s.strip_suffix(".0").map(str::to_string).unwrap_or(s)
    } else {
        let s = format!("{ms:.2}");
        s.trim_end_matches('0').to_string()
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_curve_per_series_with_its_percentiles_in_the_legend() {
        let fleet: Vec<f64> = (1..=1000).map(|i| f64::from(i) / 100.0).collect();
        let floor = [0.2, 0.3, 0.4];
        let svg = latency_cdf(
            "tool calls <256 in flight> & floor",
            &[
                Series {
                    name: "fleet",
                    sorted_ms: &fleet,
                },
                Series {
                    name: "floor",
                    sorted_ms: &floor,
                },
            ],
        );
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("tool calls &lt;256 in flight&gt; &amp; floor"));
        assert!(
            svg.contains("fleet — p50 5 ms, p99 9.9 ms, n = 1000"),
            "{svg}"
        );
        assert!(svg.contains("floor — p50 0.3 ms"), "{svg}");
        // Decades from 0.1 ms to 10 ms cover both curves.
        assert!(svg.contains(">0.1<") && svg.contains(">10<"), "{svg}");
        // Deterministic: the same input gives the same file.
        assert_eq!(
            svg,
            latency_cdf(
                "tool calls <256 in flight> & floor",
                &[
                    Series {
                        name: "fleet",
                        sorted_ms: &fleet
                    },
                    Series {
                        name: "floor",
                        sorted_ms: &floor
                    }
                ]
            )
        );
    }

    #[test]
    fn long_runs_are_thinned_and_empty_runs_still_draw() {
        let many: Vec<f64> = (1..=100_000).map(f64::from).collect();
        let svg = latency_cdf(
            "many",
            &[
                Series {
                    name: "many",
                    sorted_ms: &many,
                },
                Series {
                    name: "none",
                    sorted_ms: &[],
                },
            ],
        );
        let points = svg
            .split("points=\"")
            .nth(1)
            .and_then(|p| p.split('"').next())
            .unwrap_or_default();
        assert_eq!(points.split(' ').count(), MAX_POINTS);
        assert!(
            points.ends_with(&format!(",{TOP:.1}")),
            "the last point is at 100 %"
        );
        assert!(svg.contains("none — no samples"));
        assert_eq!(sample_indices(3), vec![0, 1, 2]);
        let thinned = sample_indices(1000);
        assert_eq!((thinned[0], *thinned.last().unwrap()), (0, 999));
    }

    #[test]
    fn labels_are_short() {
        assert_eq!(ms_label(0.25), "0.25");
        assert_eq!(ms_label(0.5), "0.5");
        assert_eq!(ms_label(2.0), "2");
        assert_eq!(ms_label(2.5), "2.5");
        assert_eq!(ms_label(1500.0), "1500");
    }
}
