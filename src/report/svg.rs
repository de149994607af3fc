//! Minimal SVG charts: grouped/stacked bars and a heatmap. Hand-written because the charts are
//! simple and a plotting crate's text layout needs font files our air-gapped CI may not have;
//! SVG text is laid out by the viewer.

use std::fmt::Write;

const PALETTE: [&str; 10] = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// Bars for `categories` (x axis), one series per entry of `series` (name, value per category).
/// `stacked` piles the series; otherwise they stand side by side.
pub fn bar_chart(title: &str, categories: &[String], series: &[(String, Vec<f64>)], stacked: bool, y_label: &str) -> String {
    let (w, h, left, bottom, top, right) = (760.0, 420.0, 60.0, 90.0, 40.0, 170.0);
    let plot_w = w - left - right;
    let plot_h = h - top - bottom;
    let ymax = if stacked {
        (0..categories.len()).map(|c| series.iter().map(|s| s.1.get(c).copied().unwrap_or(0.0)).sum::<f64>()).fold(0.0, f64::max)
    } else {
        series.iter().flat_map(|s| s.1.iter().copied()).fold(0.0, f64::max)
    };
    let ymax = if ymax <= 0.0 { 1.0 } else { ymax * 1.05 };
    let mut s = header(w, h, title);
    axis(&mut s, left, top, plot_w, plot_h, ymax, y_label);
    let slot = plot_w / categories.len().max(1) as f64;
    for (ci, cat) in categories.iter().enumerate() {
        let x0 = left + slot * ci as f64;
        let mut acc = 0.0;
        let n = series.len().max(1) as f64;
        for (si, (_, vals)) in series.iter().enumerate() {
            let v = vals.get(ci).copied().unwrap_or(0.0);
            let bh = v / ymax * plot_h;
            let (x, bw, y) = if stacked {
                let y = top + plot_h - (acc + v) / ymax * plot_h;
                (x0 + slot * 0.15, slot * 0.7, y)
            } else {
                let bw = slot * 0.8 / n;
                (x0 + slot * 0.1 + bw * si as f64, bw, top + plot_h - bh)
            };
            acc += v;
            let _ = writeln!(s, r#"<rect x="{x:.1}" y="{y:.1}" width="{bw:.1}" height="{bh:.1}" fill="{}"><title>{}: {v}</title></rect>"#, PALETTE[si % PALETTE.len()], esc(&series[si].0));
        }
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end" transform="rotate(-35 {:.1} {:.1})">{}</text>"#,
            x0 + slot / 2.0,
            top + plot_h + 14.0,
            x0 + slot / 2.0,
            top + plot_h + 14.0,
            esc(cat)
        );
    }
    legend(&mut s, w - right + 10.0, top, series.iter().map(|x| x.0.as_str()));
    s.push_str("</svg>\n");
    s
}

/// A matrix as coloured cells with their values (e.g. a confusion matrix: rows gold, cols predicted).
pub fn heatmap(title: &str, rows: &[String], cols: &[String], values: &[Vec<f64>], row_label: &str, col_label: &str) -> String {
    let cell = 48.0;
    let (left, top) = (110.0, 70.0);
    let w = left + cell * cols.len() as f64 + 30.0;
    let h = top + cell * rows.len() as f64 + 90.0;
    let max = values.iter().flatten().copied().fold(0.0, f64::max).max(1e-12);
    let mut s = header(w, h, title);
    for (r, row) in values.iter().enumerate() {
        for (c, &v) in row.iter().enumerate() {
            let t = v / max;
            let shade = (255.0 - 200.0 * t) as u8;
            let (x, y) = (left + cell * c as f64, top + cell * r as f64);
            let _ = writeln!(s, r##"<rect x="{x}" y="{y}" width="{cell}" height="{cell}" fill="rgb({shade},{shade},255)" stroke="#fff"/>"##);
            let _ = writeln!(s, r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">{}</text>"#, x + cell / 2.0, y + cell / 2.0 + 4.0, fmt_num(v));
        }
    }
    for (r, name) in rows.iter().enumerate() {
        let _ = writeln!(s, r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="end">{}</text>"#, left - 6.0, top + cell * r as f64 + cell / 2.0 + 4.0, esc(name));
    }
    for (c, name) in cols.iter().enumerate() {
        let (x, y) = (left + cell * c as f64 + cell / 2.0, top + cell * rows.len() as f64 + 14.0);
        let _ = writeln!(s, r#"<text x="{x:.1}" y="{y:.1}" font-size="12" text-anchor="end" transform="rotate(-35 {x:.1} {y:.1})">{}</text>"#, esc(name));
    }
    let _ = writeln!(s, r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">{}</text>"#, left + cell * cols.len() as f64 / 2.0, h - 8.0, esc(col_label));
    let _ = writeln!(s, r#"<text x="14" y="{:.1}" font-size="12" transform="rotate(-90 14 {:.1})" text-anchor="middle">{}</text>"#, top + cell * rows.len() as f64 / 2.0, top + cell * rows.len() as f64 / 2.0, esc(row_label));
    s.push_str("</svg>\n");
    s
}

fn fmt_num(v: f64) -> String {
    if v.fract() == 0.0 { format!("{v:.0}") } else { format!("{v:.2}") }
}

fn header(w: f64, h: f64, title: &str) -> String {
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" font-family=\"sans-serif\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{:.1}\" y=\"22\" font-size=\"15\" text-anchor=\"middle\">{}</text>\n",
        w / 2.0,
        esc(title)
    )
}

fn axis(s: &mut String, left: f64, top: f64, pw: f64, ph: f64, ymax: f64, label: &str) {
    let _ = writeln!(s, r#"<line x1="{left}" y1="{top}" x2="{left}" y2="{:.1}" stroke="black"/>"#, top + ph);
    let _ = writeln!(s, r#"<line x1="{left}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="black"/>"#, top + ph, left + pw, top + ph);
    for i in 0..=4 {
        let v = ymax * i as f64 / 4.0;
        let y = top + ph - ph * i as f64 / 4.0;
        let _ = writeln!(s, r##"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" font-size="10" text-anchor="end">{}</text>"##, left, left + pw, left - 4.0, y + 3.0, fmt_num((v * 100.0).round() / 100.0));
    }
    let _ = writeln!(s, r#"<text x="14" y="{:.1}" font-size="12" transform="rotate(-90 14 {:.1})" text-anchor="middle">{}</text>"#, top + ph / 2.0, top + ph / 2.0, esc(label));
}

fn legend<'a>(s: &mut String, x: f64, y: f64, names: impl Iterator<Item = &'a str>) {
    for (i, n) in names.enumerate() {
        let yy = y + 18.0 * i as f64;
        let _ = writeln!(s, r#"<rect x="{x}" y="{yy}" width="12" height="12" fill="{}"/><text x="{:.1}" y="{:.1}" font-size="12">{}</text>"#, PALETTE[i % PALETTE.len()], x + 16.0, yy + 10.0, esc(n));
    }
}
