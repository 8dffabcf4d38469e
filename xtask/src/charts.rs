//! SVG charts of `cargo xtask bench e2e`: one line per agent over the Service counts of a run,
//! drawn with `plotters`' SVG backend (text is left to the viewer's sans-serif font, so no font
//! file is needed).

use std::path::{Path, PathBuf};

use anyhow::{Result, anyhow};
use plotters::prelude::*;

/// One agent's points, `(Services, value)`.
pub(crate) struct Series {
    pub(crate) agent: String,
    pub(crate) points: Vec<(f64, f64)>,
}

/// A line chart of `series` against the Service count, both axes logarithmic (sizes and
/// figures span orders of magnitude); returns the file written.
pub(crate) fn write(
    dir: &Path,
    file: &str,
    title: &str,
    y_label: &str,
    series: &[Series],
) -> Result<Option<PathBuf>> {
    let all: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .filter(|(x, y)| *x > 0.0 && *y > 0.0)
        .collect();
    if all.is_empty() {
        return Ok(None);
    }
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (x, y) in &all {
        x0 = x0.min(*x);
        x1 = x1.max(*x);
        y0 = y0.min(*y);
        y1 = y1.max(*y);
    }
    // Room around the points (and a range for a single size).
    let (x0, x1) = (x0 / 1.5, x1 * 1.5);
    let (y0, y1) = (y0 / 2.0, y1 * 2.0);
    std::fs::create_dir_all(dir)?;
    let path = dir.join(file);
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(&path, (720, 440)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("Services")
            .y_desc(y_label)
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.3}"))
            .draw()?;
        for (i, s) in series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let points: Vec<(f64, f64)> = s
                .points
                .iter()
                .copied()
                .filter(|(x, y)| *x > 0.0 && *y > 0.0)
                .collect();
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
                .label(s.agent.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
            chart.draw_series(points.iter().map(|p| Circle::new(*p, 4, color.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| anyhow!("drawing {}: {e}", path.display()))?;
    Ok(Some(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chart_names_every_agent_and_skips_an_empty_one() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("xtask-charts-{}", std::process::id()));
        let series = vec![
            Series {
                agent: "kube-ipvs".into(),
                points: vec![(1000.0, 1.2), (10000.0, 16.0)],
            },
            Series {
                agent: "kube-proxy-ipvs".into(),
                points: vec![(1000.0, 40.0), (10000.0, 900.0)],
            },
        ];
        let path = write(&dir, "c.svg", "converge", "seconds", &series)?
            .ok_or_else(|| anyhow!("no chart written"))?;
        let svg = std::fs::read_to_string(&path)?;
        assert!(svg.contains("kube-ipvs") && svg.contains("kube-proxy-ipvs"));
        assert!(svg.contains("converge"));
        let none = write(&dir, "n.svg", "empty", "s", &[])?;
        assert!(none.is_none());
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
