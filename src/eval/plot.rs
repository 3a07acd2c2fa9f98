//! Line charts as PNGs: frame, axes, series of lines with dots, and a legend; one chart, or
//! several side by side. Shared by `report --speed` (speedup against density), `report
//! --speed-map` (the same for many models, CPU and GPU panels) and `bench --plot` (CPU against
//! GPU gains).
use crate::{Error, Result};
use plotters::prelude::*;
use std::path::Path;

/// One line of a chart.
pub struct Series {
    pub label: String,
    pub color: RGBColor,
    pub width: u32,
    /// Mark each point with a dot.
    pub dots: bool,
    pub points: Vec<(f64, f64)>,
}

impl Series {
    /// The ideal speedup `1 / density` (thin grey, no dots), up to `y_max`.
    pub fn ideal(y_max: f64) -> Self {
        Series {
            label: "ideal (1 / density)".into(),
            color: RGBColor(160, 160, 160),
            width: 1,
            dots: false,
            points: (1..=100)
                .map(|i| i as f64 / 100.0)
                .filter(|d| 1.0 / d <= y_max)
                .map(|d| (d, 1.0 / d))
                .collect(),
        }
    }
}

/// The axes of a chart: x from 0 to `x_max`, y from 0 to `y_max`.
#[derive(Clone, Copy)]
pub struct Axes<'a> {
    pub x_desc: &'a str,
    pub x_max: f64,
    pub y_desc: &'a str,
    pub y_max: f64,
}

/// One chart of [`panels`].
pub struct Panel<'a> {
    pub title: String,
    pub axes: Axes<'a>,
    pub series: Vec<Series>,
}

/// Draw `series` on `axes` into a 760x560 PNG at `path` (written as `crate::fsio` writes), the
/// legend at the upper right.
pub fn line_chart(path: &Path, title: &str, axes: Axes, series: &[Series]) -> Result<()> {
    crate::eval::report::register_font()?;
    crate::fsio::write_via_path(path, |tmp| {
        let root = BitMapBackend::new(tmp, (760, 560)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        draw(&root, title, axes, series)?;
        root.present().map_err(|e| err(&e))
    })
}

/// Charts side by side (760x560 each) under one `title`, into a PNG at `path`.
pub fn panels(path: &Path, title: &str, charts: &[Panel]) -> Result<()> {
    crate::eval::report::register_font()?;
    crate::fsio::write_via_path(path, |tmp| {
        let n = charts.len().max(1) as u32;
        let root = BitMapBackend::new(tmp, (760 * n, 600)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let root = root
            .titled(title, ("sans-serif", 20))
            .map_err(|e| err(&e))?;
        for (area, c) in root.split_evenly((1, n as usize)).iter().zip(charts) {
            draw(area, &c.title, c.axes, &c.series)?;
        }
        root.present().map_err(|e| err(&e))
    })
}

fn err(e: &dyn std::fmt::Display) -> Error {
    Error::Invalid(format!("plot: {e}"))
}

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    axes: Axes,
    series: &[Series],
) -> Result<()> {
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 17))
        .margin(14)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d(0f64..axes.x_max, 0f64..axes.y_max)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc(axes.x_desc)
        .y_desc(axes.y_desc)
        .label_style(("sans-serif", 12))
        .draw()
        .map_err(|e| err(&e))?;
    for s in series {
        let (c, w) = (s.color, s.width);
        chart
            .draw_series(LineSeries::new(s.points.clone(), c.stroke_width(w)))
            .map_err(|e| err(&e))?
            .label(s.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], c.stroke_width(w)));
        if s.dots {
            chart
                .draw_series(s.points.iter().map(|&p| Circle::new(p, 4, c.filled())))
                .map_err(|e| err(&e))?;
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(|e| err(&e))?;
    Ok(())
}
