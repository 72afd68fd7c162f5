//! The plots, drawn by the benchmark itself: lateness of short retries in the short/long mix
//! (ladder vs per-message TTL), and capacity (ladder vs minimal relay). PNG through plotters'
//! bitmap backend; text needs a TTF font, loaded from Debian's fonts-dejavu-core.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::stats::{Capacity, Mix, Step};

/// Where Debian's fonts-dejavu-core puts its sans-serif face.
const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// Registers the font under plotters' `sans-serif` family; without it no text can be drawn.
pub fn init_font() -> Result<()> {
    let bytes = std::fs::read(FONT).map_err(|e| anyhow!("{FONT}: {e} (apt-get install fonts-dejavu-core)"))?;
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    for style in [FontStyle::Normal, FontStyle::Bold] {
        plotters::style::register_font("sans-serif", style, bytes).map_err(|_| anyhow!("{FONT}: not a usable font"))?;
    }
    Ok(())
}

fn err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("drawing: {e}")
}

/// Cumulative distribution of the short retries' lateness, ladder vs per-message TTL, log x.
pub fn lateness(mix: &Mix, path: &Path) -> Result<()> {
    let root = BitMapBackend::new(path, (1000, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let max = mix
        .streams
        .iter()
        .flat_map(|s| s.short_values.iter().copied())
        .max()
        .unwrap_or(1000)
        .max(1000) as f64;
    let caption = format!(
        "Lateness of {} ms retries mixed with {} ms ones (1 in {}), {}/s each",
        mix.short_ms, mix.long_ms, mix.long_every, mix.rate
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 24))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d((1f64..max * 1.5).log_scale(), 0f64..1.02f64)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("lateness: redelivery - (publish + delay), ms, log scale (<= 1 ms drawn at 1 ms)")
        .y_desc("fraction of short retries")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .label_style(("sans-serif", 16))
        .axis_desc_style(("sans-serif", 18))
        .draw()
        .map_err(err)?;
    let colors = [BLUE, RED];
    for (i, s) in mix.streams.iter().enumerate() {
        let mut v: Vec<f64> = s.short_values.iter().map(|&l| (l as f64).max(1.0)).collect();
        v.sort_by(f64::total_cmp);
        let n = v.len().max(1) as f64;
        let points: Vec<(f64, f64)> = v.iter().enumerate().map(|(k, &x)| (x, (k + 1) as f64 / n)).collect();
        let color = colors[i % colors.len()];
        let label = format!(
            "{}: p50 {} ms, p99 {} ms, max {} ms",
            s.name, s.short.p50, s.short.p99, s.short.max
        );
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(3)))
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 25, y)], color.stroke_width(3)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font(("sans-serif", 18))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// Left: capacity of ladder and relay per configuration. Right: p99 lateness against offered
/// rate for every capacity step, with the 100 ms criterion.
pub fn capacity(caps: &[Capacity], steps: &[Step], path: &Path) -> Result<()> {
    let root = BitMapBackend::new(path, (1400, 620)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let root = root
        .titled(
            "Capacity: highest retry rate with p99 lateness < 100 ms (1 s tier), ladder vs minimal relay",
            ("sans-serif", 24),
        )
        .map_err(err)?;
    let (left, right) = root.split_horizontally(560);
    bars(caps, &left)?;
    curves(caps, steps, &right)?;
    root.present().map_err(err)?;
    Ok(())
}

fn bars(caps: &[Capacity], area: &DrawingArea<BitMapBackend<'_>, Shift>) -> Result<()> {
    let n = caps.len() as u32 * 2;
    let top = caps.iter().flat_map(|c| [c.ladder, c.relay]).fold(100.0, f64::max) * 1.25;
    let mut chart = ChartBuilder::on(area)
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d((0u32..n).into_segmented(), 0f64..top)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n as usize)
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) if *i < n && i % 2 == 0 => "ladder".into(),
            SegmentValue::CenterOf(i) if *i < n => "relay".into(),
            _ => String::new(),
        })
        .y_label_formatter(&|v| format!("{v:.0}"))
        .y_desc("retries per second")
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .draw()
        .map_err(err)?;
    for (i, c) in caps.iter().enumerate() {
        let i = i as u32;
        let color = Palette99::pick(i as usize).to_rgba();
        for (k, value) in [(0, c.ladder), (1, c.relay)] {
            let x = 2 * i + k;
            let style = if k == 0 {
                color.filled()
            } else {
                color.mix(0.45).filled()
            };
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(SegmentValue::Exact(x), 0.0), (SegmentValue::Exact(x + 1), value)],
                    style,
                )))
                .map_err(err)?;
            chart
                .draw_series(std::iter::once(Text::new(
                    format!("{value:.0}"),
                    (SegmentValue::Exact(x), value + top * 0.02),
                    ("sans-serif", 16),
                )))
                .map_err(err)?;
        }
        let ratio = if c.relay > 0.0 { c.ladder / c.relay } else { 0.0 };
        for (text, y) in [(c.cfg.clone(), 0.96), (format!("ladder/relay {ratio:.2}"), 0.91)] {
            chart
                .draw_series(std::iter::once(Text::new(
                    text,
                    (SegmentValue::Exact(2 * i), top * y),
                    ("sans-serif", 14),
                )))
                .map_err(err)?;
        }
    }
    Ok(())
}

fn curves(caps: &[Capacity], steps: &[Step], area: &DrawingArea<BitMapBackend<'_>, Shift>) -> Result<()> {
    // per (config, target): the best p99 at each offered rate (a step passes if either try does)
    let mut series: BTreeMap<(usize, &str), BTreeMap<u64, i64>> = BTreeMap::new();
    for s in steps.iter().filter(|s| s.phase == "capacity") {
        let Some(ci) = caps.iter().position(|c| c.cfg == s.cfg) else {
            continue;
        };
        let p99 = if s.stopped_early {
            s.e2e.p99.max(s.e2e.max)
        } else {
            s.e2e.p99
        };
        let e = series
            .entry((ci, s.target.as_str()))
            .or_default()
            .entry(s.offered as u64)
            .or_insert(i64::MAX);
        *e = (*e).min(p99.max(1));
    }
    let max_rate = steps.iter().map(|s| s.offered).fold(1000.0, f64::max) * 1.05;
    let max_p99 = series
        .values()
        .flat_map(|m| m.values().copied())
        .max()
        .unwrap_or(1000)
        .max(1000) as f64;
    let mut chart = ChartBuilder::on(area)
        .margin(15)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..max_rate, (1f64..max_p99 * 2.0).log_scale())
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("offered retries per second")
        .y_desc("p99 lateness, ms (log)")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .draw()
        .map_err(err)?;
    chart
        .draw_series(LineSeries::new(
            vec![(0.0, 100.0), (max_rate, 100.0)],
            BLACK.stroke_width(1),
        ))
        .map_err(err)?
        .label("100 ms criterion")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 25, y)], BLACK.stroke_width(1)));
    for ((ci, target), points) in &series {
        let base = Palette99::pick(*ci).to_rgba();
        let ladder = *target == "ladder";
        let color = if ladder { base } else { base.mix(0.45) };
        let pts: Vec<(f64, f64)> = points.iter().map(|(&r, &p)| (r as f64, p as f64)).collect();
        let label = format!("{} {}", caps[*ci].cfg, target);
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 25, y)], color.stroke_width(3)));
        if ladder {
            chart
                .draw_series(pts.iter().map(|&p| Circle::new(p, 5, color.filled())))
                .map_err(err)?;
        } else {
            chart
                .draw_series(pts.iter().map(|&p| TriangleMarker::new(p, 6, color.filled())))
                .map_err(err)?;
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    Ok(())
}
