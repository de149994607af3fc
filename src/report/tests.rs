//! The figures rendered from fixed data: the SVG carries the title, axis labels, legend
//! entries and one mark per value; the PNG decodes to the figure's size and is not blank.

use super::benches;
use super::plot::{check_extension, tick, Categorical, Chart, Figure, Heatmap, Style, PALETTE};
use serde_json::json;

fn hex(c: plotters::style::RGBColor) -> String {
    format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
}

/// Filled rectangles of colour `c` in an SVG (bars and legend boxes).
fn rects_of(svg: &str, c: plotters::style::RGBColor) -> usize {
    svg.matches(&format!("fill=\"{}\" stroke=\"none\"", hex(c))).count()
}

/// A text element reading `s` (plotters' SVG puts the text on a line of its own).
fn text(svg: &str, s: &str) -> bool {
    svg.contains(&format!(">\n{s}\n</text>"))
}

fn bars(style: Style) -> Categorical {
    Categorical {
        title: "Tone per emotion".into(),
        x_label: "forecast emotion".into(),
        y_label: "replies".into(),
        categories: ["joy", "sadness", "anger"].map(String::from).to_vec(),
        series: vec![("warm".into(), vec![3.0, 0.0, 12.0]), ("calm".into(), vec![1.0, 7.0, 2.0])],
        style,
        values: true,
        ..Default::default()
    }
}

#[test]
fn grouped_bars_have_title_axes_legend_and_one_bar_per_value() {
    let svg = Figure::from(bars(Style::Grouped)).svg().unwrap();
    for s in ["Tone per emotion", "forecast emotion", "replies", "joy", "sadness", "anger", "warm", "calm"] {
        assert!(text(&svg, s), "{s} missing");
    }
    // Three bars and a legend box per series.
    assert_eq!(rects_of(&svg, PALETTE[0]), 4);
    assert_eq!(rects_of(&svg, PALETTE[1]), 4);
    // Nice ticks from 0 (up to 12 plus headroom), printed as integers.
    for t in ["0", "2", "4", "10", "12"] {
        assert!(text(&svg, t), "tick {t}");
    }
    let texts: Vec<&str> = svg.split("</text>").filter_map(|t| t.rsplit_once(">\n")).map(|(_, t)| t.trim()).collect();
    assert!(texts.iter().all(|t| !t.ends_with(".0") && !t.contains("0000")), "tick labels without float noise: {texts:?}");
}

#[test]
fn stacked_bars_and_a_dashed_bound_are_drawn_and_named() {
    let mut c = bars(Style::Stacked);
    c.limit = Some(("roofline".into(), vec![5.0, f64::NAN, 20.0]));
    let fig = Figure::from(c);
    let svg = fig.svg().unwrap();
    assert_eq!(rects_of(&svg, PALETTE[0]), 4);
    assert!(text(&svg, "roofline"));
    // Slices tall enough carry their value (3, 12, 7; not the 1 and 2 slivers), piles their total.
    for v in ["3", "12", "7", "4", "14"] {
        assert!(text(&svg, v), "value {v}");
    }
    // Dashed bounds: many short black segments (two bounds and the legend's).
    assert!(svg.matches("stroke=\"#000000\"").count() > 6, "{svg}");
}

#[test]
fn a_line_chart_has_a_dot_per_value_and_a_legend_line() {
    let mut c = bars(Style::Lines);
    c.values = false;
    let svg = Figure::from(c).svg().unwrap();
    // Three dots per series and one in each legend line.
    assert_eq!(svg.matches("<circle").count(), 8, "{svg}");
    assert!(text(&svg, "warm") && text(&svg, "calm"));
}

#[test]
fn heatmap_has_a_cell_per_entry_with_its_value() {
    let labels: Vec<String> = ["neutral", "joy", "surprise"].map(String::from).to_vec();
    let values = vec![vec![9.0, 1.0, 0.0], vec![2.0, 8.0, 3.0], vec![4.0, 5.0, 6.0]];
    let h = Heatmap { title: "confusion".into(), rows: labels.clone(), cols: labels, values, row_label: "gold".into(), col_label: "forecast".into() };
    let svg = Figure::from(h).svg().unwrap();
    for s in ["confusion", "gold", "forecast", "neutral", "joy", "surprise"] {
        assert!(text(&svg, s), "{s} missing");
    }
    for v in [0, 1, 2, 3, 4, 5, 6, 8, 9] {
        assert!(text(&svg, &v.to_string()), "cell value {v}");
    }
    // Cells: every filled rectangle but the white background; the largest count is darkest.
    let cells = svg.matches("stroke=\"none\"").count() - svg.matches("fill=\"#FFFFFF\" stroke=\"none\"").count();
    assert_eq!(cells, 8, "nine cells, the zero one white: {svg}");
    assert!(svg.contains("fill=\"#2A5C9A\""), "the maximum gets the full shade");
}

#[test]
fn png_decodes_to_the_figure_size_and_is_not_blank() {
    let fig = Figure { title: Some("two panels".into()), charts: vec![Chart::Categorical(bars(Style::Grouped)), Chart::Categorical(bars(Style::Stacked))] };
    let png = fig.png().unwrap();
    let img = image::load_from_memory_with_format(&png, image::ImageFormat::Png).unwrap().to_rgb8();
    assert_eq!(img.dimensions(), fig.size());
    let colours: std::collections::HashSet<[u8; 3]> = img.pixels().map(|p| p.0).collect();
    // White, black text and axes, antialiased text greys, and the two series' colours.
    assert!(colours.len() > 8, "{} colours", colours.len());
    for c in [PALETTE[0], PALETTE[1]] {
        assert!(colours.contains(&[c.0, c.1, c.2]), "bar colour {c:?}");
    }
    // Text was rasterised: dark pixels in the title band.
    let dark = (0..img.width()).flat_map(|x| (0..30).map(move |y| (x, y))).filter(|&(x, y)| img.get_pixel(x, y).0[0] < 100).count();
    assert!(dark > 50, "title pixels: {dark}");
}

#[test]
fn empty_charts_say_no_data() {
    let c = Categorical { title: "selected round".into(), ..Default::default() };
    let fig = Figure::from(c);
    assert!(text(&fig.svg().unwrap(), "no data"));
    fig.png().unwrap();
}

#[test]
fn ticks_and_file_formats() {
    assert_eq!([tick(0.0), tick(12.0), tick(0.30000000000000004), tick(2.5), tick(1250.0), tick(37.25), tick(3555.51)], ["0", "12", "0.3", "2.5", "1250", "37.2", "3556"]);
    assert!(check_extension("a/b.svg".as_ref()).is_ok() && check_extension("b.PNG".as_ref()).is_ok());
    let e = check_extension("fig.jpg".as_ref()).err().unwrap().to_string();
    assert!(e.contains(".svg or .png"), "{e}");
}

fn categorical(c: &Chart) -> &Categorical {
    match c {
        Chart::Categorical(c) => c,
        Chart::Heatmap(_) => panic!("a heatmap"),
    }
}

#[test]
fn bench_figure_puts_each_format_against_its_roofline() {
    let rec = |w: &str, decode: f64, pct: f64| {
        json!({"weights": w, "family": "qwen2_5_vl", "device": "cpu", "prompt_tokens": 16, "decode_tokens": 4, "dummy": true,
               "decode_tokens_per_s": decode, "decode_roofline_pct": pct, "prefill_tokens_per_s": 100.0, "prefill_peak_pct": 25.0,
               "batched": [{"batch": 8, "tokens_per_s": decode * 5.0}]})
    };
    let fig = benches::bench(&[rec("f32", 10.0, 50.0), rec("q8_0", 30.0, 40.0)]);
    let decode = categorical(&fig.charts[0]);
    assert_eq!(decode.categories, ["f32", "q8_0"]);
    assert_eq!(decode.series[1], ("batch 8 (aggregate)".to_string(), vec![50.0, 150.0]));
    assert_eq!(decode.limit.as_ref().unwrap().1, [20.0, 75.0], "decode is pct % of the bound");
    assert_eq!(categorical(&fig.charts[1]).limit.as_ref().unwrap().1, [400.0, 400.0]);
    let svg = fig.svg().unwrap();
    for s in ["decode", "prefill", "tokens/s", "weights", "batch 1", "batch 8 (aggregate)", "bandwidth roofline (batch 1)", "compute peak", "f32", "q8_0"] {
        assert!(text(&svg, s), "{s}");
    }
    assert!(svg.contains("merg bench: qwen2_5_vl on cpu, 16-token prompt, 4 decoded (random weights)"));
    // Without a roofline no bound is drawn or named.
    let fig = benches::bench(&[json!({"weights": "f32", "decode_tokens_per_s": 3.0, "prefill_tokens_per_s": 9.0})]);
    assert!(categorical(&fig.charts[0]).limit.is_none() && !fig.svg().unwrap().contains("roofline"));
}

#[test]
fn bench_agents_figure_shows_each_pair_and_the_tokens_computed() {
    let run = |wall: f64, computed: u64, cached: u64| json!({"wall_s": wall, "stats": {"prefix": {"computed_tokens": computed, "cached_tokens": cached}}});
    let r = json!({"dialogues": 2, "keyframes": 1, "new_tokens": 2, "wall_ratio": 0.5, "pair_walls_s": [[1.0, 2.0], [1.2, 2.2]],
                   "with_cache": run(1.0, 300, 700), "without_cache": run(2.0, 1000, 0)});
    let fig = benches::bench_agents(&r).unwrap();
    let wall = categorical(&fig.charts[0]);
    assert_eq!(wall.series, [("cache on".to_string(), vec![0.5, 0.6]), ("cache off".to_string(), vec![1.0, 1.1])]);
    let tokens = categorical(&fig.charts[1]);
    assert_eq!(tokens.categories, ["cache on", "cache off"]);
    assert_eq!(tokens.series[0].1, [300.0, 1000.0]);
    let svg = fig.svg().unwrap();
    for s in ["wall per dialogue", "prompt tokens", "cache on", "cache off", "computed", "from the cache", "seconds"] {
        assert!(text(&svg, s), "{s}");
    }
    // A server's run: one bar each.
    let server = json!({"order": "stage", "slots": 4, "dialogues": 4, "requests": 32, "wall_s": 8.0, "computed_tokens": 900, "cached_tokens": 100});
    let fig = benches::bench_agents(&server).unwrap();
    assert_eq!(categorical(&fig.charts[0]).series[0].1, [2.0]);
    assert!(text(&fig.svg().unwrap(), "stage order, 4 slot(s)"));
    assert!(benches::bench_agents(&json!([1, 2])).is_err());
}

#[test]
fn serve_load_figure_has_a_point_per_level() {
    let rows = json!([
        {"clients": 1, "requests": 8, "rps": 20.0, "p50": 0.05, "p99": 0.06, "ttft_p50": 0.01},
        {"clients": 8, "requests": 64, "rps": 90.0, "p50": 0.09, "p99": 0.12, "ttft_p50": 0.02},
        {"clients": 64, "requests": 512, "rps": 150.0, "p50": 0.4, "p99": 0.7, "ttft_p50": 0.1},
    ]);
    let fig = benches::serve_load(&rows).unwrap();
    assert_eq!(categorical(&fig.charts[1]).series[1].1, [60.0, 120.0, 700.0]);
    let svg = fig.svg().unwrap();
    // 3 levels × 4 series, plus a dot in each legend line.
    assert_eq!(svg.matches("<circle").count(), 16);
    for s in ["concurrent streaming clients", "requests/s", "ms", "p50", "p99", "time to first token, p50", "1", "8", "64"] {
        assert!(text(&svg, s), "{s}");
    }
    assert!(benches::serve_load(&json!({"rows": []})).is_err());
}
