//! Charts for `merg report` and the benches' `--plot`, drawn with plotters. A figure is data
//! (`Figure`: panels side by side, each a `Chart`); one drawing function, generic over the
//! plotters backend, renders it to SVG or PNG, so both files show the same thing.
//!
//! Text is laid out with DejaVu Sans, embedded (fonts/, Bitstream Vera licence): the PNG
//! rasteriser (`raster`) needs glyphs, and an embedded font needs no fontconfig and draws the
//! same everywhere. SVG viewers draw the text with their own sans-serif, at the same positions.

use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use plotters::coord::ranged1d::{KeyPointHint, NoDefaultFormatting, Ranged, ValueFormatter};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

pub(super) const FONT: &[u8] = include_bytes!("fonts/DejaVuSans.ttf");
/// The family every plotters text style defaults to; the embedded font is registered as it.
const FAMILY: &str = "sans-serif";

/// Tableau 10: distinct hues that stay apart in greyscale and for common colour blindness.
pub const PALETTE: [RGBColor; 10] = [
    RGBColor(0x4e, 0x79, 0xa7),
    RGBColor(0xf2, 0x8e, 0x2b),
    RGBColor(0xe1, 0x57, 0x59),
    RGBColor(0x76, 0xb7, 0xb2),
    RGBColor(0x59, 0xa1, 0x4f),
    RGBColor(0xed, 0xc9, 0x48),
    RGBColor(0xb0, 0x7a, 0xa1),
    RGBColor(0xff, 0x9d, 0xa7),
    RGBColor(0x9c, 0x75, 0x5f),
    RGBColor(0xba, 0xb0, 0xac),
];

/// How a categorical chart draws its series.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Style {
    /// Side by side within each category.
    #[default]
    Grouped,
    /// Piled up, one bar per category.
    Stacked,
    /// A line through the category centres, a dot at each value.
    Lines,
}

/// Values per category (x axis), one series per entry: bars or lines.
#[derive(Clone, Debug, Default)]
pub struct Categorical {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub categories: Vec<String>,
    /// (name, one value per category).
    pub series: Vec<(String, Vec<f64>)>,
    pub style: Style,
    /// A bound per category (e.g. the roofline), drawn as a dashed line across its slot and
    /// named in the legend; NaN for none.
    pub limit: Option<(String, Vec<f64>)>,
    /// Print each value above its bar or dot.
    pub values: bool,
}

/// A matrix as shaded cells with their values (a confusion matrix: rows gold, columns predicted).
#[derive(Clone, Debug, Default)]
pub struct Heatmap {
    pub title: String,
    pub rows: Vec<String>,
    pub cols: Vec<String>,
    pub values: Vec<Vec<f64>>,
    pub row_label: String,
    pub col_label: String,
}

#[derive(Clone, Debug)]
pub enum Chart {
    Categorical(Categorical),
    Heatmap(Heatmap),
}

/// Panels side by side under an optional overall title.
#[derive(Clone, Debug)]
pub struct Figure {
    pub title: Option<String>,
    pub charts: Vec<Chart>,
}

/// A chart with categories along x and values up y.
type CategoryChart<'a, DB> = ChartContext<'a, DB, Cartesian2d<Categories, RangedCoordf64>>;

type Drawn<DB> = Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

/// Registers the embedded font once per process (plotters keeps a global font table).
fn font_ready() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if plotters::style::register_font(FAMILY, FontStyle::Normal, FONT).is_err() {
            panic!("the embedded DejaVu Sans does not parse");
        }
    });
}

/// Width in pixels of `text` at `size`, as the renderer will lay it out.
fn text_width(text: &str, size: u32) -> u32 {
    font_ready();
    (FAMILY, size).into_font().box_size(text).map(|(w, _)| w).unwrap_or(text.len() as u32 * size / 2)
}

/// Tick and value labels: integers without decimals, others to three significant digits or
/// the unit (hundreds up), no trailing zeros (plotters' default prints `10.0` and `0.30000`).
pub fn tick(v: f64) -> String {
    if (v - v.round()).abs() < 1e-9 || v.abs() >= 100.0 {
        return format!("{:.0}", v.round());
    }
    let digits = if v.abs() >= 10.0 { 1 } else if v.abs() >= 1.0 { 2 } else { 3 };
    let s = format!("{v:.digits$}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// A categorical axis: category `i` spans [i, i+1), its tick and label sit at i + 0.5, and
/// bars within it are placed at fractional positions. (plotters' segmented coordinates only
/// place values at segment edges or centres, and mis-map a single segment.)
struct Categories(usize);

impl Ranged for Categories {
    type FormatOption = NoDefaultFormatting;
    type ValueType = f64;
    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        limit.0 + ((limit.1 - limit.0) as f64 * v / self.0 as f64).round() as i32
    }
    fn key_points<H: KeyPointHint>(&self, hint: H) -> Vec<f64> {
        // Every category when they fit the hint, else every k-th.
        let step = self.0.div_ceil(hint.max_num_points().max(1)).max(1);
        (0..self.0).step_by(step).map(|i| i as f64 + 0.5).collect()
    }
    fn range(&self) -> Range<f64> {
        0.0..self.0 as f64
    }
}

impl ValueFormatter<f64> for Categories {
    /// Never used: every chart gives its category names as the label formatter.
    fn format(_: &f64) -> String {
        String::new()
    }
}

/// The name of the category whose slot holds `v` (`reversed`: slot 0 is the last name).
fn category_name(names: &[String], v: f64, reversed: bool) -> String {
    let i = v.floor().max(0.0) as usize;
    let i = if reversed { names.len().checked_sub(i + 1) } else { Some(i) };
    i.and_then(|i| names.get(i)).cloned().unwrap_or_default()
}

const TITLE_SIZE: u32 = 17;
const LABEL_SIZE: u32 = 13;
const DESC_SIZE: u32 = 14;
const LEGEND_SIZE: u32 = 13;
const HEIGHT: u32 = 440;

impl Categorical {
    /// Width: a slot per category wide enough for its name and its bars, a legend column.
    fn size(&self) -> (u32, u32) {
        let label = self.categories.iter().map(|c| text_width(c, LABEL_SIZE)).max().unwrap_or(0);
        let bars = if self.style == Style::Grouped { self.series.len() as u32 * 22 } else { 36 };
        let slot = (label + 16).max(bars + 20).max(70);
        let plot = (slot * self.categories.len().max(1) as u32).max(300);
        (90 + plot + legend_width(&self.legend_names()), HEIGHT)
    }

    fn legend_names(&self) -> Vec<(String, Swatch)> {
        let mut v: Vec<(String, Swatch)> = self
            .series
            .iter()
            .enumerate()
            .map(|(i, (n, _))| (n.clone(), if self.style == Style::Lines { Swatch::Line(i) } else { Swatch::Box(i) }))
            .collect();
        if let Some((n, _)) = &self.limit {
            v.push((n.clone(), Swatch::Dashed));
        }
        v
    }

    /// (min, max) of the y axis: from zero (or below, for negative values) to the largest
    /// bar, pile or bound, with headroom for the value labels.
    fn y_range(&self) -> (f64, f64) {
        let n = self.categories.len();
        let value = |s: &(String, Vec<f64>), c: usize| s.1.get(c).copied().filter(|v| v.is_finite()).unwrap_or(0.0);
        let tops = (0..n).map(|c| match self.style {
            Style::Stacked => self.series.iter().map(|s| value(s, c)).sum::<f64>(),
            _ => self.series.iter().map(|s| value(s, c)).fold(0.0, f64::max),
        });
        let limits = self.limit.iter().flat_map(|(_, v)| v.iter().copied().filter(|v| v.is_finite()));
        let max = tops.chain(limits).fold(0.0, f64::max);
        let min = self.series.iter().flat_map(|s| s.1.iter().copied().filter(|v| v.is_finite())).fold(0.0, f64::min);
        let max = if max <= 0.0 { 1.0 } else { max * if self.values { 1.15 } else { 1.05 } };
        (min * 1.05, max)
    }

    /// (how many y ticks at most, the label area's width). Counts get whole-number ticks: no
    /// more ticks than integers in the range. The area fits the widest tick label and the
    /// axis description.
    fn y_ticks(&self) -> (usize, u32) {
        let (y0, y1) = self.y_range();
        let whole = |v: &f64| !v.is_finite() || v.fract() == 0.0;
        let counts = self.series.iter().all(|s| s.1.iter().all(whole)) && self.limit.iter().all(|l| l.1.iter().all(whole));
        let labels = if counts { ((y1 - y0).floor() as usize + 1).clamp(2, 8) } else { 8 };
        let widest = RangedCoordf64::from(y0..y1).key_points(labels).iter().map(|&t| text_width(&tick(t), LABEL_SIZE)).max().unwrap_or(0);
        (labels, widest + 44)
    }

    /// The gap between a value and its label: 1 % of the y axis.
    fn lift(&self) -> f64 {
        let (lo, hi) = self.y_range();
        (hi - lo) * 0.01
    }

    /// The bar (x0, x1, y0, y1) of series `s` in category `c`, in axis units.
    fn bar(&self, s: usize, c: usize) -> (f64, f64, f64, f64) {
        let v = self.series[s].1.get(c).copied().filter(|v| v.is_finite()).unwrap_or(0.0);
        let x = c as f64;
        match self.style {
            Style::Stacked => {
                let below: f64 = self.series[..s].iter().map(|t| t.1.get(c).copied().filter(|v| v.is_finite()).unwrap_or(0.0)).sum();
                (x + 0.2, x + 0.8, below, below + v)
            }
            _ => {
                let w = 0.8 / self.series.len().max(1) as f64;
                let x0 = x + 0.1 + w * s as f64;
                (x0, x0 + w * 0.92, 0.0, v)
            }
        }
    }

    fn draw<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> Drawn<DB> {
        let legend = self.legend_names();
        let (plot_area, legend_area) = area.split_horizontally(area.dim_in_pixel().0 - legend_width(&legend));
        if self.categories.is_empty() {
            return no_data(&plot_area, &self.title);
        }
        let n = self.categories.len();
        let (y0, y1) = self.y_range();
        let (y_labels, y_area) = self.y_ticks();
        let mut chart = ChartBuilder::on(&plot_area)
            .caption(&self.title, (FAMILY, TITLE_SIZE))
            .margin(12)
            .x_label_area_size(if self.x_label.is_empty() { 30 } else { 52 })
            .y_label_area_size(y_area)
            .build_cartesian_2d(Categories(n), y0..y1)?;
        let names = |v: &f64| category_name(&self.categories, *v, false);
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n)
            .x_label_formatter(&names)
            .y_labels(y_labels)
            .y_label_formatter(&|v| tick(*v))
            .max_light_lines(0)
            .bold_line_style(RGBColor(0xdd, 0xdd, 0xdd))
            .x_desc(&self.x_label)
            .y_desc(&self.y_label)
            .label_style((FAMILY, LABEL_SIZE))
            .axis_desc_style((FAMILY, DESC_SIZE))
            .draw()?;
        match self.style {
            Style::Lines => self.draw_lines(&mut chart)?,
            _ => self.draw_bars(&mut chart)?,
        }
        self.draw_limit(&mut chart)?;
        draw_legend(&legend_area, &legend)
    }

    fn draw_bars<DB: DrawingBackend>(&self, chart: &mut CategoryChart<DB>) -> Drawn<DB> {
        let n = self.categories.len();
        for (s, _) in self.series.iter().enumerate() {
            let color = PALETTE[s % PALETTE.len()];
            let bars = (0..n).map(|c| self.bar(s, c));
            chart.draw_series(bars.map(|(x0, x1, y0, y1)| Rectangle::new([(x0, y0), (x1, y1)], color.filled())))?;
        }
        if !self.values {
            return Ok(());
        }
        // After every bar, so no later bar covers a label.
        let lift = self.lift();
        let value = |s: usize, c: usize| self.series[s].1.get(c).copied().filter(|v| v.is_finite());
        let all = (0..self.series.len()).flat_map(|s| (0..n).map(move |c| (s, c)));
        let labels: Vec<_> = match self.style {
            // Inside each slice tall enough for its text, the pile's total above it.
            Style::Stacked => {
                let slices = all.filter_map(|(s, c)| value(s, c).map(|v| (self.bar(s, c), v)));
                let slices = slices.filter(|&((_, _, y0, y1), _)| y1 - y0 >= 5.0 * lift).map(|((x0, x1, y0, y1), v)| {
                    Text::new(tick(v), ((x0 + x1) / 2.0, (y0 + y1) / 2.0), anchored(11, HPos::Center, VPos::Center).color(&WHITE))
                });
                let totals = (0..n).filter_map(|c| {
                    let total: f64 = (0..self.series.len()).filter_map(|s| value(s, c)).sum();
                    (total != 0.0).then(|| value_label((c as f64 + 0.5, total), total, lift))
                });
                slices.chain(totals).collect()
            }
            _ => all.filter_map(|(s, c)| value(s, c).map(|v| (self.bar(s, c), v))).map(|((x0, x1, _, y1), v)| value_label(((x0 + x1) / 2.0, y1), v, lift)).collect(),
        };
        chart.draw_series(labels)?;
        Ok(())
    }

    fn draw_lines<DB: DrawingBackend>(&self, chart: &mut CategoryChart<DB>) -> Drawn<DB> {
        let lift = self.lift();
        for (s, (_, values)) in self.series.iter().enumerate() {
            let color = PALETTE[s % PALETTE.len()];
            let points: Vec<(f64, f64)> = values.iter().enumerate().filter(|(_, v)| v.is_finite()).map(|(c, &v)| (c as f64 + 0.5, v)).collect();
            chart.draw_series(std::iter::once(PathElement::new(points.clone(), color.stroke_width(2))))?;
            chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
            if self.values {
                chart.draw_series(points.iter().map(|&(x, v)| value_label((x, v), v, 2.0 * lift)))?;
            }
        }
        Ok(())
    }

    /// The bounds: a dashed black line across each category's slot.
    fn draw_limit<DB: DrawingBackend>(&self, chart: &mut CategoryChart<DB>) -> Drawn<DB> {
        let Some((_, limits)) = &self.limit else { return Ok(()) };
        let lines = limits.iter().enumerate().filter(|(_, v)| v.is_finite());
        chart.draw_series(lines.map(|(c, &v)| DashedPathElement::new(vec![(c as f64 + 0.04, v), (c as f64 + 0.96, v)], 6, 4, BLACK.stroke_width(2))))?;
        Ok(())
    }
}

/// Text of `size` anchored at (`h`, `v`) of its box.
fn anchored(size: u32, h: HPos, v: VPos) -> TextStyle<'static> {
    TextStyle::from((FAMILY, size)).pos(Pos::new(h, v))
}

/// `v` printed just above the point `at`: `lift` is a small step up, in axis units.
fn value_label(at: (f64, f64), v: f64, lift: f64) -> Text<'static, (f64, f64), String> {
    Text::new(tick(v), (at.0, at.1 + lift), anchored(11, HPos::Center, VPos::Bottom))
}

impl Heatmap {
    fn cell(&self) -> u32 {
        let label = self.cols.iter().map(|c| text_width(c, LABEL_SIZE)).max().unwrap_or(0);
        (label + 12).max(52)
    }

    fn size(&self) -> (u32, u32) {
        let rows = self.rows.iter().map(|r| text_width(r, LABEL_SIZE)).max().unwrap_or(0);
        let cell = self.cell();
        let w = (rows + 60 + cell * self.cols.len().max(1) as u32 + 30).max(text_width(&self.title, TITLE_SIZE) + 40);
        (w, 60 + cell * self.rows.len().max(1) as u32 + 70)
    }

    fn draw<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> Drawn<DB> {
        let (nr, nc) = (self.rows.len(), self.cols.len());
        if nr == 0 || nc == 0 {
            return no_data(area, &self.title);
        }
        let rows_w = self.rows.iter().map(|r| text_width(r, LABEL_SIZE)).max().unwrap_or(0);
        // Square cells: the plot spans cell × columns, centred in what the panel leaves.
        let cell = self.cell() as i32;
        let spare = area.dim_in_pixel().0 as i32 - (rows_w as i32 + 40 + cell * nc as i32);
        let mut chart = ChartBuilder::on(area)
            .caption(&self.title, (FAMILY, TITLE_SIZE))
            .margin_top(12)
            .margin_bottom(12)
            .margin_left(12)
            .margin_right(spare.max(12))
            .x_label_area_size(48)
            .y_label_area_size(rows_w + 28)
            .build_cartesian_2d(Categories(nc), Categories(nr))?;
        // Row 0 at the top: the y axis counts upward, so slot k holds row nr-1-k.
        let col_names = |v: &f64| category_name(&self.cols, *v, false);
        let row_names = |v: &f64| category_name(&self.rows, *v, true);
        chart
            .configure_mesh()
            .disable_mesh()
            .x_labels(nc)
            .y_labels(nr)
            .x_label_formatter(&col_names)
            .y_label_formatter(&row_names)
            .x_desc(&self.col_label)
            .y_desc(&self.row_label)
            .label_style((FAMILY, LABEL_SIZE))
            .axis_desc_style((FAMILY, DESC_SIZE))
            .draw()?;
        let max = self.values.iter().flatten().copied().filter(|v| v.is_finite()).fold(0.0, f64::max).max(1e-12);
        let cells = self.values.iter().enumerate().flat_map(|(r, row)| row.iter().enumerate().map(move |(c, &v)| (r, c, v)));
        let cells: Vec<(usize, usize, f64)> = cells.filter(|&(r, c, _)| r < nr && c < nc).collect();
        chart.draw_series(cells.iter().map(|&(r, c, v)| {
            let y = (nr - 1 - r) as f64;
            Rectangle::new([(c as f64, y), (c as f64 + 1.0, y + 1.0)], shade(v / max).filled())
        }))?;
        chart.draw_series(cells.iter().map(|&(r, c, v)| {
            // Constants, so the style borrows them for 'static.
            let ink: &'static RGBColor = if v / max > 0.6 { &WHITE } else { &BLACK };
            let style = anchored(LABEL_SIZE, HPos::Center, VPos::Center).color(ink);
            Text::new(tick(v), (c as f64 + 0.5, (nr - 1 - r) as f64 + 0.5), style)
        }))?;
        Ok(())
    }
}

/// White to the palette's blue as `t` goes from 0 to 1.
fn shade(t: f64) -> RGBColor {
    let t = if t.is_finite() { t.clamp(0.0, 1.0) } else { 0.0 };
    let mix = |to: u8| (255.0 - (255.0 - to as f64) * t).round() as u8;
    RGBColor(mix(0x2a), mix(0x5c), mix(0x9a))
}

/// A legend entry's mark: a filled box (bars), a line with a dot (lines), a dashed line (bounds).
#[derive(Clone, Copy, Debug)]
enum Swatch {
    Box(usize),
    Line(usize),
    Dashed,
}

fn legend_width(entries: &[(String, Swatch)]) -> u32 {
    entries.iter().map(|(n, _)| text_width(n, LEGEND_SIZE) + 46).max().unwrap_or(0)
}

/// The legend as a column right of the plot, level with its top, so it never covers data.
fn draw_legend<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, entries: &[(String, Swatch)]) -> Drawn<DB> {
    for (i, (name, swatch)) in entries.iter().enumerate() {
        let y = 50 + 22 * i as i32;
        match *swatch {
            Swatch::Box(k) => area.draw(&Rectangle::new([(6, y - 6), (20, y + 6)], PALETTE[k % PALETTE.len()].filled()))?,
            Swatch::Line(k) => {
                let color = PALETTE[k % PALETTE.len()];
                area.draw(&PathElement::new(vec![(2, y), (24, y)], color.stroke_width(2)))?;
                area.draw(&Circle::new((13, y), 4, color.filled()))?;
            }
            Swatch::Dashed => area.draw(&DashedPathElement::new(vec![(2, y), (24, y)], 6, 4, BLACK.stroke_width(2)))?,
        }
        area.draw(&Text::new(name.as_str(), (30, y), anchored(LEGEND_SIZE, HPos::Left, VPos::Center)))?;
    }
    Ok(())
}

/// A panel with its title and "no data" (a run with nothing to count).
fn no_data<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, title: &str) -> Drawn<DB> {
    let (w, h) = area.dim_in_pixel();
    let body = area.titled(title, (FAMILY, TITLE_SIZE))?;
    body.draw(&Text::new("no data", (w as i32 / 2, h as i32 / 2 - 30), anchored(DESC_SIZE, HPos::Center, VPos::Center)))
}

impl Chart {
    fn size(&self) -> (u32, u32) {
        match self {
            Chart::Categorical(c) => c.size(),
            Chart::Heatmap(h) => h.size(),
        }
    }

    fn draw<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> Drawn<DB> {
        match self {
            Chart::Categorical(c) => c.draw(area),
            Chart::Heatmap(h) => h.draw(area),
        }
    }
}

impl From<Categorical> for Figure {
    fn from(c: Categorical) -> Figure {
        Figure { title: None, charts: vec![Chart::Categorical(c)] }
    }
}

impl From<Heatmap> for Figure {
    fn from(h: Heatmap) -> Figure {
        Figure { title: None, charts: vec![Chart::Heatmap(h)] }
    }
}

const FIGURE_TITLE_BAND: u32 = 36;

/// A figure file's format.
pub enum Format {
    Svg,
    Png,
}

/// The format a figure file's name asks for; commands check it before they measure anything.
pub fn check_extension(path: &Path) -> Result<Format> {
    match path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase).as_deref() {
        Some("svg") => Ok(Format::Svg),
        Some("png") => Ok(Format::Png),
        _ => bail!("{}: a figure is written as .svg or .png", path.display()),
    }
}

impl Figure {
    /// Pixels: the panels' widths added (or the title's, when wider), the tallest panel, the
    /// title's band.
    pub fn size(&self) -> (u32, u32) {
        font_ready();
        let sizes: Vec<(u32, u32)> = self.charts.iter().map(Chart::size).collect();
        let title = self.title.as_ref().map(|t| text_width(t, TITLE_SIZE + 2) + 40).unwrap_or(0);
        let w = sizes.iter().map(|s| s.0).sum::<u32>().max(title).max(320);
        let h = sizes.iter().map(|s| s.1).max().unwrap_or(200) + if self.title.is_some() { FIGURE_TITLE_BAND } else { 0 };
        (w, h)
    }

    /// The one drawing function both formats go through.
    fn draw<DB: DrawingBackend>(&self, root: DrawingArea<DB, Shift>) -> Drawn<DB> {
        root.fill(&WHITE)?;
        let mut rest = match &self.title {
            Some(t) => root.titled(t, (FAMILY, TITLE_SIZE + 2))?,
            None => root.clone(),
        };
        for chart in &self.charts {
            let (panel, right) = rest.split_horizontally(chart.size().0);
            chart.draw(&panel)?;
            rest = right;
        }
        root.present()
    }

    pub fn svg(&self) -> Result<String> {
        let mut out = String::new();
        let size = self.size();
        self.draw(SVGBackend::with_string(&mut out, size).into_drawing_area()).map_err(|e| anyhow!("drawing the SVG: {e}"))?;
        Ok(out)
    }

    /// PNG bytes, encoded by our own `image` from plotters' RGB buffer.
    pub fn png(&self) -> Result<Vec<u8>> {
        let (w, h) = self.size();
        let mut rgb = vec![0u8; w as usize * h as usize * 3];
        self.draw(super::raster::Png(BitMapBackend::with_buffer(&mut rgb, (w, h))).into_drawing_area()).map_err(|e| anyhow!("drawing the PNG: {e}"))?;
        let img = image::RgbImage::from_raw(w, h, rgb).context("PNG buffer size")?;
        let mut out = std::io::Cursor::new(vec![]);
        img.write_to(&mut out, image::ImageFormat::Png)?;
        Ok(out.into_inner())
    }

    /// Writes the figure as `path`'s extension says: `.svg` or `.png`.
    pub fn save(&self, path: &Path) -> Result<()> {
        let bytes = match check_extension(path)? {
            Format::Svg => self.svg()?.into_bytes(),
            Format::Png => self.png()?,
        };
        std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
    }

    /// Writes `<stem>.svg` and `<stem>.png` under `dir`; returns both paths.
    pub fn save_both(&self, dir: &Path, stem: &str) -> Result<Vec<PathBuf>> {
        let paths = vec![dir.join(format!("{stem}.svg")), dir.join(format!("{stem}.png"))];
        for p in &paths {
            self.save(p)?;
        }
        Ok(paths)
    }
}
