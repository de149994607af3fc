//! The PNG backend: plotters' `BitMapBackend` for every shape, text rasterised here. plotters
//! 0.3.7's ab_glyph path drops each glyph's left side bearing, so letters sit unevenly
//! ("T one", "ang er"); here each glyph is drawn where the font puts it on the baseline, with
//! plotters' anchoring and quarter-turn rotations. Sizes follow the SVG backend (an em of
//! size / 1.24 pixels), so the PNG and the SVG show text alike.

use std::sync::OnceLock;

use ab_glyph::{point, Font, FontRef, PxScale, ScaleFont};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, VPos};
use plotters_backend::{BackendColor, BackendCoord, BackendStyle, BackendTextStyle, DrawingErrorKind};

/// plotters' text size is a line height; its SVG backend writes font-size = size / 1.24.
const SIZE_PER_EM: f32 = 1.24;

fn font() -> &'static FontRef<'static> {
    static FONT: OnceLock<FontRef<'static>> = OnceLock::new();
    FONT.get_or_init(|| FontRef::try_from_slice(super::plot::FONT).expect("the embedded DejaVu Sans parses"))
}

pub struct Png<'a>(pub BitMapBackend<'a>);

type Drawn<'a> = Result<(), DrawingErrorKind<<BitMapBackend<'a> as DrawingBackend>::ErrorType>>;

impl<'a> DrawingBackend for Png<'a> {
    type ErrorType = <BitMapBackend<'a> as DrawingBackend>::ErrorType;

    fn get_size(&self) -> (u32, u32) {
        self.0.get_size()
    }
    fn ensure_prepared(&mut self) -> Drawn<'a> {
        self.0.ensure_prepared()
    }
    fn present(&mut self) -> Drawn<'a> {
        self.0.present()
    }
    fn draw_pixel(&mut self, point: BackendCoord, color: BackendColor) -> Drawn<'a> {
        self.0.draw_pixel(point, color)
    }
    fn draw_line<S: BackendStyle>(&mut self, from: BackendCoord, to: BackendCoord, style: &S) -> Drawn<'a> {
        self.0.draw_line(from, to, style)
    }
    fn draw_rect<S: BackendStyle>(&mut self, upper_left: BackendCoord, bottom_right: BackendCoord, style: &S, fill: bool) -> Drawn<'a> {
        self.0.draw_rect(upper_left, bottom_right, style, fill)
    }
    fn draw_path<S: BackendStyle, I: IntoIterator<Item = BackendCoord>>(&mut self, path: I, style: &S) -> Drawn<'a> {
        self.0.draw_path(path, style)
    }
    fn draw_circle<S: BackendStyle>(&mut self, center: BackendCoord, radius: u32, style: &S, fill: bool) -> Drawn<'a> {
        self.0.draw_circle(center, radius, style, fill)
    }
    fn fill_polygon<S: BackendStyle, I: IntoIterator<Item = BackendCoord>>(&mut self, vert: I, style: &S) -> Drawn<'a> {
        self.0.fill_polygon(vert, style)
    }
    fn blit_bitmap(&mut self, pos: BackendCoord, size: (u32, u32), src: &[u8]) -> Drawn<'a> {
        self.0.blit_bitmap(pos, size, src)
    }

    fn draw_text<T: BackendTextStyle>(&mut self, text: &str, style: &T, pos: BackendCoord) -> Drawn<'a> {
        let color = style.color();
        if color.alpha == 0.0 {
            return Ok(());
        }
        let (w, h) = self.get_size();
        let anchor = style.anchor();
        let turn = style.transform();
        let (bw, bh) = extent(text, style.size() as f32);
        for ((x, y), coverage) in rasterise(text, style.size() as f32) {
            let dx = match anchor.h_pos {
                HPos::Left => 0,
                HPos::Center => -bw / 2,
                HPos::Right => -bw,
            };
            let dy = match anchor.v_pos {
                VPos::Top => 0,
                VPos::Center => -bh / 2,
                VPos::Bottom => -bh,
            };
            let (x, y) = turn.transform(x + dx, y + dy);
            let (x, y) = (pos.0 + x, pos.1 + y);
            if x >= 0 && y >= 0 && (x as u32) < w && (y as u32) < h {
                self.0.draw_pixel((x, y), color.mix(coverage as f64))?;
            }
        }
        Ok(())
    }
}

/// The font at plotters' text `size`.
fn scaled(size: f32) -> ab_glyph::PxScaleFont<&'static FontRef<'static>> {
    let f = font();
    let em = size / SIZE_PER_EM;
    let units = f.units_per_em().unwrap_or(2048.0);
    f.as_scaled(PxScale::from(em * f.height_unscaled() / units))
}

/// (width, height) of the text's box: advances and kerning; ascent to descent.
fn extent(text: &str, size: f32) -> (i32, i32) {
    let f = scaled(size);
    let (mut x, mut prev) = (0.0, None);
    for c in text.chars() {
        let id = f.glyph_id(c);
        x += prev.map(|p| f.kern(p, id)).unwrap_or(0.0) + f.h_advance(id);
        prev = Some(id);
    }
    (x.round() as i32, (f.ascent() - f.descent()).round() as i32)
}

/// Each covered pixel of `text` with its coverage, relative to the top left of its box (the
/// baseline one ascent down).
fn rasterise(text: &str, size: f32) -> Vec<((i32, i32), f32)> {
    let f = scaled(size);
    let (mut caret, mut prev, mut out) = (0.0, None, vec![]);
    for c in text.chars() {
        let id = f.glyph_id(c);
        caret += prev.map(|p| f.kern(p, id)).unwrap_or(0.0);
        if let Some(g) = f.outline_glyph(id.with_scale_and_position(f.scale(), point(caret, f.ascent()))) {
            let b = g.px_bounds();
            g.draw(|x, y, coverage| {
                if coverage > 0.0 {
                    out.push(((b.min.x as i32 + x as i32, b.min.y as i32 + y as i32), coverage));
                }
            });
        }
        caret += f.h_advance(id);
        prev = Some(id);
    }
    out
}
