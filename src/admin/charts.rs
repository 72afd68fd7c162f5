//! Small line charts for the overview, drawn on the server as inline SVG: no script, no
//! front-end build, nothing loaded (the page's Content-Security-Policy allows none). Pure: a
//! [`Chart`] of values in, markup out; maud escapes every text. Colours come from the
//! stylesheet's `.s0`… classes, so a chart carries no `style` attribute the policy would refuse.

use maud::{Markup, html};

/// The drawing's size in SVG units; the stylesheet scales it to the column's width.
const WIDTH: f64 = 320.0;
const HEIGHT: f64 = 120.0;
/// Room for the y axis' labels on the left and the x axis' labels below.
const LEFT: f64 = 40.0;
const RIGHT: f64 = 8.0;
const TOP: f64 = 8.0;
const BOTTOM: f64 = 18.0;

/// What a chart's values count, for its axis labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Messages (per minute, or waiting).
    Messages,
    /// Seconds, shown as ms below one.
    Seconds,
}

/// One line: a value per slot (`None`: not known, a gap in the line).
#[derive(Debug, Clone)]
pub struct Series {
    /// Its name in the legend.
    pub name: String,
    /// One value per slot of the chart, oldest first.
    pub values: Vec<Option<f64>>,
    /// For counts per slot: their sum over the chart's span, shown in the legend beside the
    /// latest slot's (which reads 0 just after a minute begins).
    pub total: Option<f64>,
}

/// A chart of `slots` evenly spaced points in time, the last one now.
#[derive(Debug, Clone)]
pub struct Chart {
    /// Its title, also the drawing's accessible name.
    pub title: String,
    /// What the values count.
    pub unit: Unit,
    /// How many points the x axis spans.
    pub slots: usize,
    /// What the left end of the x axis is called (`-60 min`).
    pub start_label: String,
    /// The lines, drawn in order with classes `s0`, `s1`, …
    pub series: Vec<Series>,
}

/// The smallest of 1, 2 or 5 times a power of ten that is at least `v` (at least `floor`): the
/// top of a chart's y axis, so its labels read as round numbers.
pub fn nice_ceiling(v: f64, floor: f64) -> f64 {
    let v = if v.is_finite() { v.max(floor) } else { floor };
    if v <= 0.0 {
        return 1.0;
    }
    let power = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * power)
        .find(|top| *top >= v * (1.0 - 1e-12))
        .unwrap_or(10.0 * power)
}

/// A value as an axis or legend label.
pub fn label(v: f64, unit: Unit) -> String {
    match unit {
        Unit::Seconds if v == 0.0 => "0".into(),
        Unit::Seconds if v < 1.0 => format!("{} ms", trim(v * 1000.0)),
        Unit::Seconds => format!("{} s", trim(v)),
        Unit::Messages if v >= 1e6 => format!("{}M", trim(v / 1e6)),
        Unit::Messages if v >= 1e3 => format!("{}k", trim(v / 1e3)),
        Unit::Messages => trim(v),
    }
}

/// `v` with at most one decimal, none when it is whole.
fn trim(v: f64) -> String {
    let rounded = (v * 10.0).round() / 10.0;
    if rounded.fract() == 0.0 {
        format!("{rounded:.0}")
    } else {
        format!("{rounded:.1}")
    }
}

impl Chart {
    /// The top of the y axis: the largest value, rounded up ([`nice_ceiling`]).
    pub fn top(&self) -> f64 {
        let max = self
            .series
            .iter()
            .flat_map(|s| s.values.iter().flatten())
            .fold(0.0f64, |a, b| if b.is_finite() { a.max(*b) } else { a });
        let floor = match self.unit {
            Unit::Messages => 1.0,
            Unit::Seconds => 0.001,
        };
        nice_ceiling(max, floor)
    }

    /// Whether any value is known.
    pub fn is_empty(&self) -> bool {
        self.series.iter().all(|s| s.values.iter().all(Option::is_none))
    }

    /// The x coordinate of slot `i`.
    fn x(&self, i: usize) -> f64 {
        let span = (self.slots.max(2) - 1) as f64;
        LEFT + (WIDTH - LEFT - RIGHT) * i as f64 / span
    }

    /// The y coordinate of `v` on an axis up to `top`.
    fn y(v: f64, top: f64) -> f64 {
        let plot = HEIGHT - TOP - BOTTOM;
        HEIGHT - BOTTOM - plot * (v / top).clamp(0.0, 1.0)
    }

    /// The path of one series: a line through consecutive known values, broken at gaps; a
    /// point with no known neighbour is a dot (a zero-length segment with round caps).
    pub fn path(&self, series: &Series, top: f64) -> String {
        let mut d = String::new();
        let mut drawing = false;
        let values = &series.values[..series.values.len().min(self.slots)];
        for (i, v) in values.iter().enumerate() {
            match v.filter(|v| v.is_finite()) {
                Some(v) => {
                    let (x, y) = (self.x(i), Self::y(v, top));
                    if drawing {
                        d.push_str(&format!(" L{x:.1} {y:.1}"));
                    } else {
                        let alone = values.get(i + 1).copied().flatten().is_none();
                        d.push_str(&format!("{}M{x:.1} {y:.1}", if d.is_empty() { "" } else { " " }));
                        if alone {
                            d.push_str(" l0 0");
                        }
                        drawing = true;
                    }
                }
                None => drawing = false,
            }
        }
        d
    }

    /// Where the latest known value of `series` is drawn.
    fn latest(&self, series: &Series, top: f64) -> Option<(f64, f64)> {
        let values = &series.values[..series.values.len().min(self.slots)];
        let (i, v) = values
            .iter()
            .enumerate()
            .rev()
            .find_map(|(i, v)| v.filter(|v| v.is_finite()).map(|v| (i, v)))?;
        Some((self.x(i), Self::y(v, top)))
    }

    /// The y axis' labelled values: 0, the middle and the top — the middle only when it is a
    /// whole number of messages.
    fn ticks(&self, top: f64) -> Vec<f64> {
        let middle = top / 2.0;
        if self.unit == Unit::Messages && middle.fract() != 0.0 {
            vec![0.0, top]
        } else {
            vec![0.0, middle, top]
        }
    }

    /// The chart: its title, the drawing and a legend with each series' latest value.
    pub fn render(&self) -> Markup {
        let top = self.top();
        let (x0, x1) = (self.x(0), self.x(self.slots.max(2) - 1));
        let ticks = self.ticks(top);
        html! {
            figure .chart {
                figcaption { (self.title) }
                svg xmlns="http://www.w3.org/2000/svg" viewBox={ "0 0 " (WIDTH) " " (HEIGHT) }
                    role="img" aria-label=(self.title) {
                    title { (self.title) }
                    @for tick in ticks {
                        @let y = format!("{:.1}", Self::y(tick, top));
                        line .grid x1=(format!("{x0:.1}")) x2=(format!("{x1:.1}")) y1=(y) y2=(y) {}
                        text .axis x=(format!("{:.1}", LEFT - 4.0)) y=(y) text-anchor="end" dominant-baseline="middle" {
                            (label(tick, self.unit))
                        }
                    }
                    text .axis x=(format!("{x0:.1}")) y=(format!("{:.1}", HEIGHT - 4.0)) text-anchor="start" { (self.start_label) }
                    text .axis x=(format!("{x1:.1}")) y=(format!("{:.1}", HEIGHT - 4.0)) text-anchor="end" { "now" }
                    @if self.is_empty() {
                        text .empty x=(format!("{:.1}", (x0 + x1) / 2.0)) y=(format!("{:.1}", (HEIGHT - BOTTOM + TOP) / 2.0))
                            text-anchor="middle" { "no data yet" }
                    }
                    @for (i, s) in self.series.iter().enumerate() {
                        @let d = self.path(s, top);
                        @if !d.is_empty() {
                            path class={ "line s" (i) } d=(d) {}
                        }
                        // the latest value as a dot, so a line of one minute shows too
                        @if let Some((x, y)) = self.latest(s, top) {
                            circle class={ "dot s" (i) } cx=(format!("{x:.1}")) cy=(format!("{y:.1}")) r="2.5" {}
                        }
                    }
                }
                ul .legend {
                    @for (i, s) in self.series.iter().enumerate() {
                        li class={ "s" (i) } {
                            span .swatch {} (s.name) ": "
                            b { (s.values.iter().rev().flatten().next().map_or("–".to_string(), |v| label(*v, self.unit))) }
                            @if let Some(total) = s.total {
                                " (" span .total { (label(total, self.unit)) } " in the last " (self.slots) " min)"
                            }
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart(values: Vec<Vec<Option<f64>>>, unit: Unit) -> Chart {
        Chart {
            title: "Messages per minute".into(),
            unit,
            slots: 60,
            start_label: "-60 min".into(),
            series: values
                .into_iter()
                .enumerate()
                .map(|(i, values)| Series {
                    name: format!("series {i}"),
                    values,
                    total: None,
                })
                .collect(),
        }
    }

    /// Every tag is closed in order, and attribute values are quoted: what an XML parser
    /// needs of inline SVG (maud writes void HTML elements only for HTML names; none here).
    fn assert_well_formed(markup: &str) {
        let svg_start = markup.find("<svg").expect("an svg element");
        let svg_end = markup.find("</svg>").expect("a closed svg") + "</svg>".len();
        let svg = &markup[svg_start..svg_end];
        let mut open: Vec<String> = Vec::new();
        let mut rest = svg;
        while let Some(i) = rest.find('<') {
            rest = &rest[i + 1..];
            let end = rest.find('>').expect("a tag ends");
            let tag = &rest[..end];
            assert_eq!(tag.matches('"').count() % 2, 0, "unbalanced quotes in <{tag}>");
            if let Some(name) = tag.strip_prefix('/') {
                assert_eq!(open.pop().as_deref(), Some(name), "in {svg}");
            } else if !tag.ends_with('/') {
                open.push(tag.split_whitespace().next().unwrap().to_string());
            }
            rest = &rest[end + 1..];
        }
        assert!(open.is_empty(), "unclosed {open:?} in {svg}");
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(!svg.contains("style="), "the CSP allows no style attribute");
    }

    #[test]
    fn nice_ceilings_are_round() {
        for (v, top) in [
            (0.0, 1.0),
            (0.3, 1.0),
            (1.0, 1.0),
            (1.5, 2.0),
            (3.0, 5.0),
            (7.0, 10.0),
            (12.0, 20.0),
            (12_408.0, 20_000.0),
            (f64::NAN, 1.0),
            (f64::INFINITY, 1.0),
        ] {
            assert_eq!(nice_ceiling(v, 1.0), top, "{v}");
        }
        assert!((nice_ceiling(0.0123, 0.001) - 0.02).abs() < 1e-12);
        assert_eq!(nice_ceiling(0.0, 0.001), 0.001);
    }

    #[test]
    fn labels_read_as_people_write_them() {
        assert_eq!(label(0.0, Unit::Messages), "0");
        assert_eq!(label(50.0, Unit::Messages), "50");
        assert_eq!(label(2_500.0, Unit::Messages), "2.5k");
        assert_eq!(label(0.012, Unit::Seconds), "12 ms");
        assert_eq!(label(0.0005, Unit::Seconds), "0.5 ms");
        assert_eq!(label(2.0, Unit::Seconds), "2 s");
    }

    #[test]
    fn an_empty_history_draws_a_frame_that_says_so() {
        let c = chart(vec![vec![None; 60], Vec::new()], Unit::Messages);
        assert!(c.is_empty());
        let markup = c.render().into_string();
        assert_well_formed(&markup);
        assert!(markup.contains("no data yet"), "{markup}");
        assert!(!markup.contains("<path"), "no line without data: {markup}");
        assert!(markup.contains("series 0: <b>–</b>"), "{markup}");
    }

    #[test]
    fn a_count_per_minute_shows_its_sum_over_the_span_beside_the_latest_minute() {
        let mut values = vec![None; 60];
        values[50] = Some(6.0);
        values[59] = Some(0.0);
        let mut c = chart(vec![values], Unit::Messages);
        c.series[0].total = Some(6.0);
        let markup = c.render().into_string();
        assert_well_formed(&markup);
        assert!(
            markup.contains("series 0: <b>0</b> (<span class=\"total\">6</span> in the last 60 min)"),
            "{markup}"
        );
    }

    #[test]
    fn values_scale_into_the_plot_and_gaps_break_the_line() {
        let mut values = vec![None; 60];
        values[57] = Some(10.0);
        values[58] = Some(20.0);
        values[59] = Some(5.0);
        values[10] = Some(40.0); // alone: a dot
        let c = chart(vec![values], Unit::Messages);
        assert_eq!(c.top(), 50.0);
        let d = c.path(&c.series[0], c.top());
        // slot 10 of 0..=59 across 272 units from x = 40; 40 of 50 up a 94-unit plot from y = 102
        assert!(
            d.starts_with("M86.1 26.8 l0 0 M302.8 83.2 L307.4 64.4 L312.0 92.6"),
            "{d}"
        );
        let markup = c.render().into_string();
        assert_well_formed(&markup);
        assert!(markup.contains(">50</text>") && markup.contains(">25</text>") && markup.contains(">0</text>"));
        assert!(
            markup.contains("<circle class=\"dot s0\" cx=\"312.0\" cy=\"92.6\""),
            "the latest value's dot: {markup}"
        );
        // a top of 5 messages has no 2.5 tick
        let five = chart(vec![vec![Some(4.0); 60]], Unit::Messages);
        let drawn = five.render().into_string();
        assert!(drawn.contains(">5</text>") && !drawn.contains(">2.5</text>"), "{drawn}");
        assert!(
            markup.contains("series 0: <b>5</b>"),
            "the latest value in the legend: {markup}"
        );
        for y in d.split(['M', 'L']).filter_map(|p| p.split_whitespace().nth(1)) {
            let y: f64 = y.parse().unwrap();
            assert!((TOP..=HEIGHT - BOTTOM).contains(&y), "{y} inside the plot");
        }
    }

    #[test]
    fn titles_and_names_are_escaped() {
        let mut c = chart(vec![vec![Some(1.0); 60]], Unit::Seconds);
        c.title = "<script>alert(1)</script>".into();
        c.series[0].name = "a&b".into();
        let markup = c.render().into_string();
        assert!(!markup.contains("<script>") && markup.contains("&lt;script&gt;") && markup.contains("a&amp;b"));
        assert_well_formed(&markup);
    }
}
