//! `bench --plot`: latency against message size, log-log, as SVG.

use plotters::prelude::*;
use std::path::Path;

/// One line of the plot: (bytes, microseconds) points.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// Axis labels at the decimal grid lines of a log axis: "1 kB", "10 kB", "1 MB".
fn size_label(bytes: f64) -> String {
    const UNITS: [(f64, &str); 4] = [(1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")];
    for (scale, unit) in UNITS {
        if bytes >= scale {
            return format!("{} {unit}", trim(bytes / scale));
        }
    }
    format!("{} B", trim(bytes))
}

/// Microsecond labels: no trailing zeros.
fn time_label(us: f64) -> String {
    trim(us)
}

/// At most three significant decimals, trailing zeros dropped.
fn trim(v: f64) -> String {
    let s = format!("{v:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_string()
}

/// Distinct colours with good contrast on white.
const COLORS: [RGBColor; 9] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// Draws `series` to an SVG file at `path`.
pub fn latency_svg(path: &Path, title: &str, series: &[Series]) -> Result<(), String> {
    let pts = || series.iter().flat_map(|s| s.points.iter().copied());
    let finite = |v: f64| v.is_finite() && v > 0.0;
    let xs: Vec<f64> = pts().map(|p| p.0).filter(|&v| finite(v)).collect();
    let ys: Vec<f64> = pts().map(|p| p.1).filter(|&v| finite(v)).collect();
    if xs.is_empty() || ys.is_empty() {
        return Err("no rows to plot".into());
    }
    let (x0, x1) = min_max(&xs);
    let (y0, y1) = min_max(&ys);
    // Some room around the data; a log axis needs a non-empty range.
    let (x0, x1) = (x0 / 1.5, x1 * 1.5);
    let (y0, y1) = (y0 / 1.5, y1 * 1.5);

    let root = SVGBackend::new(path, (960, 640)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("message size per rank (bytes)")
        .y_desc("time per allreduce (us)")
        .x_label_formatter(&|x| size_label(*x))
        .y_label_formatter(&|y| time_label(*y))
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let points: Vec<(f64, f64)> = s
            .points
            .iter()
            .copied()
            .filter(|&(x, y)| finite(x) && finite(y))
            .collect();
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(s.label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|e| e.to_string())?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())?;
    Ok(())
}

fn min_max(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| {
            (a.min(x), b.max(x))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels() {
        assert_eq!(size_label(1e4), "10 kB");
        assert_eq!(size_label(1e6), "1 MB");
        assert_eq!(size_label(2.5e7), "25 MB");
        assert_eq!(size_label(512.0), "512 B");
        assert_eq!(time_label(10.0), "10");
        assert_eq!(time_label(0.25), "0.25");
    }

    #[test]
    fn writes_an_svg() {
        let dir = std::env::temp_dir().join(format!("p2p-allreduce-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("latency.svg");
        let series = vec![
            Series {
                label: "one_stage N=8".into(),
                points: vec![(4096.0, 3.1), (8192.0, 3.3), (1048576.0, 12.0)],
            },
            Series {
                label: "two_stage N=8".into(),
                points: vec![(4096.0, 4.0), (8192.0, 4.2), (1048576.0, 9.0)],
            },
        ];
        latency_svg(&path, "test", &series).expect("plot");
        let svg = std::fs::read_to_string(&path).expect("read back");
        assert!(
            svg.starts_with("<svg") && svg.contains("one_stage N=8"),
            "{}",
            &svg[..200.min(svg.len())]
        );
        assert!(latency_svg(&path, "empty", &[]).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
