//! Minimal PNG line charts (training curves, accuracy vs. length) with no font or system
//! dependencies: axes, ticks, a legend and labels drawn with a built-in 5×7 bitmap font.
use anyhow::{Context, Result};
use std::path::Path;

#[derive(Clone, Debug)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

#[derive(Clone, Debug, Default)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
    /// Fixed y range (else from the data).
    pub y_range: Option<(f64, f64)>,
    /// Draw x ticks at the data's x values (for categorical x like context lengths).
    pub x_ticks_at_data: bool,
}

const PALETTE: [[u8; 3]; 8] = [
    [31, 119, 180],
    [255, 127, 14],
    [44, 160, 44],
    [214, 39, 40],
    [148, 103, 189],
    [140, 86, 75],
    [227, 119, 194],
    [127, 127, 127],
];

struct Canvas {
    w: usize,
    h: usize,
    px: Vec<u8>,
}

impl Canvas {
    fn new(w: usize, h: usize) -> Self {
        Canvas { w, h, px: vec![255; w * h * 3] }
    }
    fn set(&mut self, x: i64, y: i64, c: [u8; 3]) {
        if x >= 0 && y >= 0 && (x as usize) < self.w && (y as usize) < self.h {
            let i = (y as usize * self.w + x as usize) * 3;
            self.px[i..i + 3].copy_from_slice(&c);
        }
    }
    fn rect(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, c: [u8; 3]) {
        for y in y0..=y1 {
            for x in x0..=x1 {
                self.set(x, y, c);
            }
        }
    }
    /// Bresenham line, `t` pixels thick.
    fn line(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, c: [u8; 3], t: i64) {
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = (if x0 < x1 { 1 } else { -1 }, if y0 < y1 { 1 } else { -1 });
        let (mut x, mut y, mut err) = (x0, y0, dx + dy);
        loop {
            self.rect(x - t / 2, y - t / 2, x + (t - 1) / 2, y + (t - 1) / 2, c);
            if x == x1 && y == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }
    /// Text at scale `s`; returns the width drawn.
    fn text(&mut self, x: i64, y: i64, s: &str, scale: i64, c: [u8; 3]) -> i64 {
        let mut cx = x;
        for ch in s.chars() {
            let g = glyph(ch);
            for (col, bits) in g.iter().enumerate() {
                for row in 0..7 {
                    if bits >> row & 1 == 1 {
                        self.rect(cx + col as i64 * scale, y + row * scale, cx + (col as i64 + 1) * scale - 1, y + (row + 1) * scale - 1, c);
                    }
                }
            }
            cx += 6 * scale;
        }
        cx - x
    }
    /// Text rotated 90° counter-clockwise (for the y label), reading bottom to top.
    fn text_vertical(&mut self, x: i64, y: i64, s: &str, scale: i64, c: [u8; 3]) {
        let mut cy = y;
        for ch in s.chars() {
            let g = glyph(ch);
            for (col, bits) in g.iter().enumerate() {
                for row in 0..7 {
                    if bits >> row & 1 == 1 {
                        let (px, py) = (x + row * scale, cy - col as i64 * scale);
                        self.rect(px, py - scale + 1, px + scale - 1, py, c);
                    }
                }
            }
            cy -= 6 * scale;
        }
    }
}

fn text_width(s: &str, scale: i64) -> i64 {
    s.chars().count() as i64 * 6 * scale
}

fn nice_ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    nice_ticks_int(lo, hi, n, false)
}

/// `integer`: ticks only at whole numbers (steps, chunk indices).
fn nice_ticks_int(lo: f64, hi: f64, n: usize, integer: bool) -> Vec<f64> {
    let span = (hi - lo).max(1e-12);
    let raw = span / n as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .filter(|s| !integer || (s.fract() == 0.0 && *s >= 1.0))
        .find(|s| span / s <= n as f64)
        .unwrap_or(if integer { (10.0 * mag).max(1.0).round() } else { 10.0 * mag });
    let mut t = (lo / step).ceil() * step;
    let mut out = vec![];
    while t <= hi + step * 1e-9 {
        out.push(if t.abs() < step * 1e-9 { 0.0 } else { t });
        t += step;
    }
    out
}

fn fmt_tick(v: f64) -> String {
    if v.abs() >= 1e4 || (v != 0.0 && v.abs() < 1e-2) {
        format!("{v:.1e}")
    } else if v.fract().abs() < 1e-9 {
        format!("{}", v as i64)
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

impl Chart {
    pub fn save_png(&self, path: &Path, w: usize, h: usize) -> Result<()> {
        save_canvas(path, &self.draw(w, h))
    }

    /// Several charts, each `w` × `h`, one above the other in one PNG (related views of one
    /// run, read together).
    pub fn save_stacked_png(charts: &[Chart], path: &Path, w: usize, h: usize) -> Result<()> {
        let mut all = Canvas { w, h: 0, px: Vec::with_capacity(charts.len() * w * h * 3) };
        for c in charts {
            let one = c.draw(w, h);
            all.px.extend_from_slice(&one.px);
            all.h += h;
        }
        save_canvas(path, &all)
    }

    fn draw(&self, w: usize, h: usize) -> Canvas {
        let mut c = Canvas::new(w, h);
        let (w, h) = (w as i64, h as i64);
        let black = [0, 0, 0];
        let grey = [225, 225, 225];
        // The legend gets its own rows between the title and the plot, so it never hides data:
        // entries laid out left to right, wrapping at the plot's width.
        let (left, right, bottom) = (90i64, 30i64, 70i64);
        let mut legend: Vec<(i64, i64)> = Vec::with_capacity(self.series.len()); // (x, row)
        let (mut lx, mut row) = (left, 0i64);
        for s in &self.series {
            let wd = 28 + text_width(&s.name, 2) + 24;
            if lx > left && lx + wd > w - right {
                (lx, row) = (left, row + 1);
            }
            legend.push((lx, row));
            lx += wd;
        }
        let rows = if self.series.is_empty() { 0 } else { row + 1 };
        let top = 40 + rows * 20 + 10;
        let (pw, ph) = (w - left - right, h - top - bottom);
        let pts: Vec<(f64, f64)> = self.series.iter().flat_map(|s| s.points.iter().copied()).filter(|p| p.0.is_finite() && p.1.is_finite()).collect();
        let (mut x0, mut x1) = pts.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |a, p| (a.0.min(p.0), a.1.max(p.0)));
        let (mut y0, mut y1) = self.y_range.unwrap_or_else(|| pts.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |a, p| (a.0.min(p.1), a.1.max(p.1))));
        if !x0.is_finite() {
            (x0, x1) = (0.0, 1.0);
        }
        if !y0.is_finite() {
            (y0, y1) = (0.0, 1.0);
        }
        if x1 - x0 < 1e-12 {
            x0 -= 0.5;
            x1 += 0.5;
        }
        if y1 - y0 < 1e-12 {
            y0 -= 0.5;
            y1 += 0.5;
        }
        if self.y_range.is_none() {
            let pad = (y1 - y0) * 0.05;
            y0 -= pad;
            y1 += pad;
        }
        let sx = |x: f64| left + ((x - x0) / (x1 - x0) * pw as f64).round() as i64;
        let sy = |y: f64| top + ph - ((y - y0) / (y1 - y0) * ph as f64).round() as i64;
        // grid + ticks
        for t in nice_ticks(y0, y1, 6) {
            let y = sy(t);
            c.line(left, y, left + pw, y, grey, 1);
            let label = fmt_tick(t);
            c.text(left - 8 - text_width(&label, 2), y - 7, &label, 2, black);
        }
        let xt: Vec<f64> = if self.x_ticks_at_data {
            let mut v: Vec<f64> = pts.iter().map(|p| p.0).collect();
            v.sort_by(|a, b| a.partial_cmp(b).unwrap());
            v.dedup();
            v
        } else {
            let integral = pts.iter().all(|p| p.0.fract() == 0.0);
            nice_ticks_int(x0, x1, 8, integral)
        };
        for t in xt {
            let x = sx(t);
            c.line(x, top, x, top + ph, grey, 1);
            let label = fmt_tick(t);
            c.text(x - text_width(&label, 2) / 2, top + ph + 8, &label, 2, black);
        }
        c.line(left, top + ph, left + pw, top + ph, black, 2);
        c.line(left, top, left, top + ph, black, 2);
        // series
        for (si, s) in self.series.iter().enumerate() {
            let col = PALETTE[si % PALETTE.len()];
            let p: Vec<(i64, i64)> = s.points.iter().filter(|p| p.0.is_finite() && p.1.is_finite()).map(|&(x, y)| (sx(x), sy(y))).collect();
            for w2 in p.windows(2) {
                c.line(w2[0].0, w2[0].1, w2[1].0, w2[1].1, col, 3);
            }
            for &(x, y) in &p {
                if p.len() <= 40 {
                    c.rect(x - 3, y - 3, x + 3, y + 3, col);
                }
            }
        }
        for (si, (s, &(lx, row))) in self.series.iter().zip(&legend).enumerate() {
            let col = PALETTE[si % PALETTE.len()];
            let ly = 40 + row * 20;
            c.rect(lx, ly + 4, lx + 20, ly + 8, col);
            c.text(lx + 28, ly, &s.name, 2, black);
        }
        c.text((w - text_width(&self.title, 2)) / 2, 14, &self.title, 2, black);
        c.text(left + (pw - text_width(&self.x_label, 2)) / 2, h - 30, &self.x_label, 2, black);
        c.text_vertical(16, top + ph / 2 + text_width(&self.y_label, 2) / 2, &self.y_label, 2, black);
        c
    }
}

fn save_canvas(path: &Path, c: &Canvas) -> Result<()> {
    let mut buf = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut buf, c.w as u32, c.h as u32);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut wr = enc.write_header().context("png header")?;
        wr.write_image_data(&c.px).context("png data")?;
    }
    crate::util::fs::write_atomic(path, &buf)
}

/// Column-major 5×7 glyphs (bit 0 = top row) for printable ASCII; '?' for anything else.
fn glyph(ch: char) -> [u8; 5] {
    const FONT: [[u8; 5]; 95] = [
        [0x00, 0x00, 0x00, 0x00, 0x00], [0x00, 0x00, 0x5F, 0x00, 0x00], [0x00, 0x07, 0x00, 0x07, 0x00],
        [0x14, 0x7F, 0x14, 0x7F, 0x14], [0x24, 0x2A, 0x7F, 0x2A, 0x12], [0x23, 0x13, 0x08, 0x64, 0x62],
        [0x36, 0x49, 0x55, 0x22, 0x50], [0x00, 0x05, 0x03, 0x00, 0x00], [0x00, 0x1C, 0x22, 0x41, 0x00],
        [0x00, 0x41, 0x22, 0x1C, 0x00], [0x08, 0x2A, 0x1C, 0x2A, 0x08], [0x08, 0x08, 0x3E, 0x08, 0x08],
        [0x00, 0x50, 0x30, 0x00, 0x00], [0x08, 0x08, 0x08, 0x08, 0x08], [0x00, 0x60, 0x60, 0x00, 0x00],
        [0x20, 0x10, 0x08, 0x04, 0x02], [0x3E, 0x51, 0x49, 0x45, 0x3E], [0x00, 0x42, 0x7F, 0x40, 0x00],
        [0x42, 0x61, 0x51, 0x49, 0x46], [0x21, 0x41, 0x45, 0x4B, 0x31], [0x18, 0x14, 0x12, 0x7F, 0x10],
        [0x27, 0x45, 0x45, 0x45, 0x39], [0x3C, 0x4A, 0x49, 0x49, 0x30], [0x01, 0x71, 0x09, 0x05, 0x03],
        [0x36, 0x49, 0x49, 0x49, 0x36], [0x06, 0x49, 0x49, 0x29, 0x1E], [0x00, 0x36, 0x36, 0x00, 0x00],
        [0x00, 0x56, 0x36, 0x00, 0x00], [0x08, 0x14, 0x22, 0x41, 0x00], [0x14, 0x14, 0x14, 0x14, 0x14],
        [0x00, 0x41, 0x22, 0x14, 0x08], [0x02, 0x01, 0x51, 0x09, 0x06], [0x32, 0x49, 0x79, 0x41, 0x3E],
        [0x7E, 0x11, 0x11, 0x11, 0x7E], [0x7F, 0x49, 0x49, 0x49, 0x36], [0x3E, 0x41, 0x41, 0x41, 0x22],
        [0x7F, 0x41, 0x41, 0x22, 0x1C], [0x7F, 0x49, 0x49, 0x49, 0x41], [0x7F, 0x09, 0x09, 0x01, 0x01],
        [0x3E, 0x41, 0x41, 0x51, 0x32], [0x7F, 0x08, 0x08, 0x08, 0x7F], [0x00, 0x41, 0x7F, 0x41, 0x00],
        [0x20, 0x40, 0x41, 0x3F, 0x01], [0x7F, 0x08, 0x14, 0x22, 0x41], [0x7F, 0x40, 0x40, 0x40, 0x40],
        [0x7F, 0x02, 0x04, 0x02, 0x7F], [0x7F, 0x04, 0x08, 0x10, 0x7F], [0x3E, 0x41, 0x41, 0x41, 0x3E],
        [0x7F, 0x09, 0x09, 0x09, 0x06], [0x3E, 0x41, 0x51, 0x21, 0x5E], [0x7F, 0x09, 0x19, 0x29, 0x46],
        [0x46, 0x49, 0x49, 0x49, 0x31], [0x01, 0x01, 0x7F, 0x01, 0x01], [0x3F, 0x40, 0x40, 0x40, 0x3F],
        [0x1F, 0x20, 0x40, 0x20, 0x1F], [0x7F, 0x20, 0x18, 0x20, 0x7F], [0x63, 0x14, 0x08, 0x14, 0x63],
        [0x03, 0x04, 0x78, 0x04, 0x03], [0x61, 0x51, 0x49, 0x45, 0x43], [0x00, 0x7F, 0x41, 0x41, 0x00],
        [0x02, 0x04, 0x08, 0x10, 0x20], [0x00, 0x41, 0x41, 0x7F, 0x00], [0x04, 0x02, 0x01, 0x02, 0x04],
        [0x40, 0x40, 0x40, 0x40, 0x40], [0x00, 0x01, 0x02, 0x04, 0x00], [0x20, 0x54, 0x54, 0x54, 0x78],
        [0x7F, 0x48, 0x44, 0x44, 0x38], [0x38, 0x44, 0x44, 0x44, 0x20], [0x38, 0x44, 0x44, 0x48, 0x7F],
        [0x38, 0x54, 0x54, 0x54, 0x18], [0x08, 0x7E, 0x09, 0x01, 0x02], [0x0C, 0x52, 0x52, 0x52, 0x3E],
        [0x7F, 0x08, 0x04, 0x04, 0x78], [0x00, 0x44, 0x7D, 0x40, 0x00], [0x20, 0x40, 0x44, 0x3D, 0x00],
        [0x7F, 0x10, 0x28, 0x44, 0x00], [0x00, 0x41, 0x7F, 0x40, 0x00], [0x7C, 0x04, 0x18, 0x04, 0x78],
        [0x7C, 0x08, 0x04, 0x04, 0x78], [0x38, 0x44, 0x44, 0x44, 0x38], [0x7C, 0x14, 0x14, 0x14, 0x08],
        [0x08, 0x14, 0x14, 0x18, 0x7C], [0x7C, 0x08, 0x04, 0x04, 0x08], [0x48, 0x54, 0x54, 0x54, 0x20],
        [0x04, 0x3F, 0x44, 0x40, 0x20], [0x3C, 0x40, 0x40, 0x20, 0x7C], [0x1C, 0x20, 0x40, 0x20, 0x1C],
        [0x3C, 0x40, 0x30, 0x40, 0x3C], [0x44, 0x28, 0x10, 0x28, 0x44], [0x0C, 0x50, 0x50, 0x50, 0x3C],
        [0x44, 0x64, 0x54, 0x4C, 0x44], [0x00, 0x08, 0x36, 0x41, 0x00], [0x00, 0x00, 0x7F, 0x00, 0x00],
        [0x00, 0x41, 0x36, 0x08, 0x00], [0x08, 0x04, 0x08, 0x10, 0x08],
    ];
    let c = ch as u32;
    if (32..127).contains(&c) {
        FONT[(c - 32) as usize]
    } else {
        FONT[('?' as u32 - 32) as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn writes_a_png() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.png");
        let ch = Chart {
            title: "Reward".into(),
            x_label: "step".into(),
            y_label: "mean reward".into(),
            series: vec![Series { name: "infomem".into(), points: (0..20).map(|i| (i as f64, (i as f64 / 3.0).sin())).collect() }],
            ..Default::default()
        };
        ch.save_png(&p, 640, 400).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        // stacked: the PNG's header says 640 × 2·400, and the top panel is the single chart
        let two = dir.path().join("two.png");
        Chart::save_stacked_png(&[ch.clone(), Chart { title: "other".into(), ..ch.clone() }], &two, 640, 400).unwrap();
        let dec = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&two).unwrap()));
        let mut rd = dec.read_info().unwrap();
        assert_eq!((rd.info().width, rd.info().height), (640, 800));
        let mut px = vec![0; rd.output_buffer_size().unwrap()];
        rd.next_frame(&mut px).unwrap();
        assert_eq!(&px[..640 * 400 * 3], &ch.draw(640, 400).px[..]);
        let t = nice_ticks(0.0, 1.0, 5);
        assert_eq!(t.len(), 6);
        assert!(t.iter().zip([0.0, 0.2, 0.4, 0.6, 0.8, 1.0]).all(|(a, b)| (a - b).abs() < 1e-9));
    }
}
