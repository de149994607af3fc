//! Dataset loaders: committed fixtures in the exact MELD / IEMOCAP formats, bad-input errors,
//! and the real MELD files from $MERG_DATA_DIR (default ../shared/data) when present.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use merg::data::meld::{self, Split};
use merg::data::{iemocap, LoadReport};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/data")
}

/// The real data folder, or None (with a message) when this machine has none.
fn real_data() -> Option<PathBuf> {
    let dir = std::env::var_os("MERG_DATA_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data"));
    if dir.join("meld/test_sent_emo.csv").is_file() {
        Some(dir)
    } else {
        println!("SKIPPED: no MELD CSVs under {} (set MERG_DATA_DIR)", dir.display());
        None
    }
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn meld_fixture_items() {
    let (items, rep) = meld::load(&fixtures().join("meld/clean"), Split::Test, None).unwrap();
    // dia0: utt 0,1,2 → 2 targets; dia1: utt 0,2,3 (gap, rows out of order) → 2; dia5: 1 row → 0.
    let keys: Vec<&str> = items.iter().map(|i| i.key.as_str()).collect();
    assert_eq!(keys, ["meld/test/dia0_utt1", "meld/test/dia0_utt2", "meld/test/dia1_utt2", "meld/test/dia1_utt3"]);
    assert_eq!((rep.utterances, rep.dialogues, rep.items, rep.first_turns), (7, 3, 4, 3));
    assert_eq!((rep.repaired_rows, rep.empty_utterances, rep.text_only_items), (0, 0, 4));

    let it = &items[3];
    assert_eq!(it.dialogue.id.as_deref(), Some("meld/test/dia1_utt3"));
    let hist: Vec<(&str, &str)> = it.dialogue.turns.iter().map(|t| (t.speaker.as_str(), t.text.as_str())).collect();
    assert_eq!(hist, [("Dev", "Guess what — I got the job!"), ("Cleo", "That’s great, when do you start?")]);
    assert_eq!(it.dialogue.turns[0].emotion.as_deref(), Some("joy"));
    assert_eq!((it.dialogue.next_speaker.as_str(), it.gold_emotion.as_str()), ("Cleo", "surprise"));
    assert_eq!(it.reference, "Wait, it’s today?!");
    it.dialogue.validate().unwrap();
    // The target's text and label never leak into its own history.
    for it in &items {
        assert!(it.dialogue.turns.iter().all(|t| t.text != it.reference));
    }
}

#[test]
fn meld_mojibake_fixture_reads_identically() {
    let (clean, rc) = meld::load(&fixtures().join("meld/clean"), Split::Test, None).unwrap();
    let (moj, rm) = meld::load(&fixtures().join("meld/mojibake"), Split::Test, None).unwrap();
    let raw = std::fs::read_to_string(fixtures().join("meld/mojibake/test_sent_emo.csv")).unwrap();
    assert!(raw.contains('\u{92}') && raw.contains('\u{a0}'), "fixture must hold C1 characters");
    assert_eq!(clean, moj);
    assert_eq!((rc.repaired_rows, rm.repaired_rows), (0, 6));
}

#[test]
fn meld_videos_missing_and_corrupt_are_counted() {
    let v = tempfile::tempdir().unwrap();
    let mp4 = b"\0\0\0\x20ftypisom\0\0\x02\0isomiso2";
    std::fs::write(v.path().join("dia0_utt0.mp4"), mp4).unwrap();
    std::fs::write(v.path().join("dia0_utt1.mp4"), b"").unwrap(); // corrupt (empty)
    std::fs::write(v.path().join("dia0_utt2.mp4"), mp4).unwrap();
    std::fs::write(v.path().join("dia1_utt3.mp4"), b"garbage that is no video").unwrap();
    let (items, rep) = meld::load(&fixtures().join("meld/clean"), Split::Test, Some(v.path())).unwrap();
    assert_eq!((rep.clips_found, rep.clips_corrupt, rep.clips_missing), (2, 2, 3));
    assert_eq!(rep.clip_problems.len(), 5);
    assert!(rep.clip_problems.iter().any(|p| p.contains("dia0_utt1.mp4: empty file")), "{:?}", rep.clip_problems);
    let by_key = |k: &str| items.iter().find(|i| i.key == k).unwrap();
    let a = by_key("meld/test/dia0_utt2");
    assert_eq!(a.dialogue.turns[0].video.as_deref(), Some(v.path().join("dia0_utt0.mp4").as_path()));
    assert_eq!(a.dialogue.turns[1].video, None);
    assert_eq!(a.target_video.as_deref(), Some(v.path().join("dia0_utt2.mp4").as_path()));
    // dia1 has no usable clip at all: both its items run text-only.
    assert_eq!(rep.text_only_items, 2);

    // The standard split folder under a release root is found.
    let root = tempfile::tempdir().unwrap();
    let sub = root.path().join(Split::Test.video_subdir());
    std::fs::create_dir(&sub).unwrap();
    std::fs::write(sub.join("dia5_utt0.mp4"), mp4).unwrap();
    let (_, rep) = meld::load(&fixtures().join("meld/clean"), Split::Test, Some(root.path())).unwrap();
    assert_eq!((rep.clips_found, rep.clips_missing), (1, 6));

    let e = meld::load(&fixtures().join("meld/clean"), Split::Test, Some(&v.path().join("nope"))).unwrap_err();
    assert!(format!("{e:#}").contains("not a readable directory"), "{e:#}");
}

const HEADER: &str = "Sr No.,Utterance,Speaker,Emotion,Sentiment,Dialogue_ID,Utterance_ID\n";

fn meld_err(body: &str) -> String {
    let d = tempfile::tempdir().unwrap();
    let p = write(d.path(), "x.csv", body);
    format!("{:#}", meld::load_csv(&p, "test", None).unwrap_err())
}

#[test]
fn meld_bad_input() {
    let e = meld_err("Sr No.,Utterance,Speaker,Dialogue_ID,Utterance_ID\n1,Hi,A,0,0\n");
    assert!(e.contains("x.csv") && e.contains("missing column") && e.contains("Emotion"), "{e}");
    let e = meld_err(&format!("{HEADER}1,Hi,A,neutral,neutral,0,0\n2,Yo,B,happiness,positive,0,1\n"));
    assert!(e.contains("line 3") && e.contains("column Emotion") && e.contains("happiness"), "{e}");
    let e = meld_err(&format!("{HEADER}1,Hi,A,neutral,neutral,0,0\n2,Yo,B,joy,positive,0,0\n"));
    assert!(e.contains("line 3") && e.contains("duplicate") && e.contains("first on line 2"), "{e}");
    let e = meld_err(&format!("{HEADER}1,Hi,A,neutral,neutral,zero,0\n"));
    assert!(e.contains("line 2") && e.contains("Dialogue_ID") && e.contains("zero"), "{e}");
    let e = meld_err(&format!("{HEADER}1,Hi,,neutral,neutral,0,0\n"));
    assert!(e.contains("line 2") && e.contains("Speaker"), "{e}");
    let e = meld_err(&format!("{HEADER}1,Hi,A,neutral\n"));
    assert!(e.contains("x.csv"), "{e}");
    let e = format!("{:#}", meld::load(Path::new("/nonexistent"), Split::Dev, None).unwrap_err());
    assert!(e.contains("/nonexistent/dev_sent_emo.csv"), "{e}");

    // Empty utterances are dropped from history and targets, and counted.
    let d = tempfile::tempdir().unwrap();
    let p = write(d.path(), "x.csv", &format!("{HEADER}1,Hi,A,neutral,neutral,0,0\n2,\"  \",B,joy,positive,0,1\n3,Bye,A,sadness,negative,0,2\n"));
    let (items, rep) = meld::load_csv(&p, "test", None).unwrap();
    assert_eq!((rep.empty_utterances, rep.utterances, items.len()), (1, 2, 1));
    assert_eq!(items[0].dialogue.turns.len(), 1);
}

fn iemocap_root() -> PathBuf {
    fixtures().join("iemocap")
}

#[test]
fn iemocap_fixture_items() {
    let (items, rep) = iemocap::load(&iemocap_root(), iemocap::TEST_SESSION, true).unwrap();
    let got: Vec<(&str, &str, &str, usize)> = items
        .iter()
        .map(|i| (i.key.as_str(), i.gold_emotion.as_str(), i.dialogue.next_speaker.as_str(), i.dialogue.turns.len()))
        .collect();
    assert_eq!(got, [
        ("iemocap/Ses05F_impro01_M000", "frustrated", "M", 1),
        ("iemocap/Ses05F_impro01_F002", "happy", "F", 3),
        ("iemocap/Ses05F_impro01_M001", "angry", "M", 4),
        ("iemocap/Ses05F_impro01_F003", "frustrated", "F", 6),
        ("iemocap/Ses05M_script01_1_F000", "happy", "F", 1),
        ("iemocap/Ses05M_script01_1_F001", "sad", "F", 3),
    ]);
    let want = LoadReport {
        utterances: 11,
        dialogues: 2,
        items: 6,
        first_turns: 2,
        empty_utterances: 1,
        skipped_labels: BTreeMap::from([("sur".to_string(), 1), ("xxx".to_string(), 1)]),
        unlabeled_turns: 1,
        unparsed_lines: 1,
        clips_found: 1,
        clips_missing: 1,
        text_only_items: 2,
        ..rep.clone()
    };
    assert_eq!(rep, want, "{}", rep.summary());
    assert_eq!(rep.sources.len(), 4);

    // History ordered by start time (M001 at 16 s is written before F002 at 12 s).
    let f003 = &items[3];
    let texts: Vec<&str> = f003.dialogue.turns.iter().map(|t| t.text.as_str()).collect();
    assert_eq!(texts, ["Excuse me.", "Do you have your forms?", "Yeah.", "Is there a problem? [LAUGHTER]", "Let me see them.", "Hmm."]);
    let emos: Vec<Option<&str>> = f003.dialogue.turns.iter().map(|t| t.emotion.as_deref()).collect();
    assert_eq!(emos, [Some("neutral"), Some("frustrated"), None, Some("happy"), Some("angry"), None]);
    assert_eq!(f003.reference, "This is ridiculous, I've been waiting for hours!");
    let rec = f003.recording.as_ref().unwrap();
    assert!(rec.path.ends_with("Session5/dialog/avi/DivX/Ses05F_impro01.avi"));
    assert_eq!(rec.turn_spans.len(), 6);
    assert_eq!((rec.turn_spans[3], rec.target_span), ((12.0, 15.5), (22.0, 24.0)));
    assert!(f003.dialogue.video.is_none() && f003.target_video.is_none());
    assert!(items[4].recording.is_none());
    let keys: HashSet<&str> = items.iter().map(|i| i.key.as_str()).collect();
    assert_eq!(keys.len(), items.len());

    let (no_video, rep) = iemocap::load(&iemocap_root(), 5, false).unwrap();
    assert!(no_video.iter().all(|i| i.recording.is_none()));
    assert_eq!((rep.clips_found, rep.clips_missing, rep.text_only_items), (0, 0, 6));
}

#[test]
fn iemocap_bad_input() {
    let e = format!("{:#}", iemocap::load(&iemocap_root(), iemocap::MEMORY_SESSION, false).unwrap_err());
    assert!(e.contains("Session2") && e.contains("transcriptions"), "{e}");

    // A copy of the fixture session, then one defect at a time.
    let copy = |tweak: &dyn Fn(&Path)| -> String {
        let d = tempfile::tempdir().unwrap();
        let dst = d.path().join("Session5/dialog");
        for sub in ["transcriptions", "EmoEvaluation"] {
            std::fs::create_dir_all(dst.join(sub)).unwrap();
            for f in std::fs::read_dir(iemocap_root().join("Session5/dialog").join(sub)).unwrap() {
                let f = f.unwrap().path();
                std::fs::copy(&f, dst.join(sub).join(f.file_name().unwrap())).unwrap();
            }
        }
        tweak(&dst);
        match iemocap::load(d.path(), 5, false) {
            Ok((items, rep)) => format!("ok {} items; {}", items.len(), rep.summary()),
            Err(e) => format!("{e:#}"),
        }
    };
    let e = copy(&|d| std::fs::remove_file(d.join("EmoEvaluation/Ses05M_script01_1.txt")).unwrap());
    assert!(e.contains("EmoEvaluation/Ses05M_script01_1.txt"), "{e}");
    let e = copy(&|d| {
        let p = d.join("transcriptions/Ses05M_script01_1.txt");
        let t = std::fs::read_to_string(&p).unwrap();
        std::fs::write(&p, format!("{t}Ses05M_script01_1_F000 [011.0-012.0]: again\n")).unwrap();
    });
    assert!(e.contains("line 5") && e.contains("repeated") && e.contains("first on line 2"), "{e}");
    let e = copy(&|d| {
        let p = d.join("transcriptions/Ses05M_script01_1.txt");
        let t = std::fs::read_to_string(&p).unwrap();
        std::fs::write(&p, format!("{t}Ses05F_impro01_F009 [011.0-012.0]: wrong file\n")).unwrap();
    });
    assert!(e.contains("does not belong to dialog Ses05M_script01_1"), "{e}");
    let e = copy(&|d| {
        let p = d.join("EmoEvaluation/Ses05M_script01_1.txt");
        let t = std::fs::read_to_string(&p).unwrap();
        std::fs::write(&p, format!("{t}[8.5000 - 10.0000]\tSes05M_script01_1_F001\tang\t[1, 1, 1]\n")).unwrap();
    });
    assert!(e.contains("evaluated twice") && e.contains("Ses05M_script01_1_F001"), "{e}");
    let e = copy(&|_| {});
    assert!(e.starts_with("ok 6 items"), "{e}");
    // Asking for video without the avi folder is an error, not a silent text-only run.
    let e = format!("{:#}", {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("Session5/dialog/transcriptions")).unwrap();
        std::fs::write(d.path().join("Session5/dialog/transcriptions/Ses05F_impro01.txt"), "").unwrap();
        iemocap::load(d.path(), 5, true).unwrap_err()
    });
    assert!(e.contains("avi/DivX") && e.contains("not a readable directory"), "{e}");
}

#[test]
fn real_meld_counts_and_mojibake_parity() {
    let Some(data) = real_data() else { return };
    let dir = data.join("meld");
    let mut total_repaired = 0;
    for (split, rows, dialogues, targets) in [(Split::Test, 2610, 280, 2330), (Split::Dev, 1109, 114, 995), (Split::Train, 9989, 1038, 8951)] {
        let (items, rep) = meld::load(&dir, split, None).unwrap();
        assert_eq!((rep.utterances, rep.dialogues, items.len()), (rows, dialogues, targets), "{split:?}: {}", rep.summary());
        assert_eq!((rep.first_turns, rep.empty_utterances, rep.repaired_rows), (dialogues, 0, 0));
        let keys: HashSet<&str> = items.iter().map(|i| i.key.as_str()).collect();
        assert_eq!(keys.len(), items.len());
        for it in &items {
            it.dialogue.validate().unwrap();
        }
        let (moj, mrep) = meld::load(&dir.join("mojibake-pre2020"), split, None).unwrap();
        assert!(mrep.repaired_rows > 0);
        total_repaired += mrep.repaired_rows;
        assert_eq!(items.len(), moj.len());
        for (a, b) in items.iter().zip(&moj) {
            assert_eq!(a, b, "{split:?} {}: clean and mojibake files differ after repair", a.key);
        }
        println!("MELD {split:?}: {} items; mojibake file: {} rows repaired", items.len(), mrep.repaired_rows);
    }
    assert!(total_repaired > 3000);

    // Label distribution of the test rows (README of the data folder).
    let mut rep = LoadReport::default();
    let rows = meld::read_rows(&dir.join("test_sent_emo.csv"), &mut rep).unwrap();
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for r in &rows {
        *counts.entry(r.emotion.as_str()).or_default() += 1;
    }
    let want = [("anger", 345), ("disgust", 68), ("fear", 50), ("joy", 402), ("neutral", 1256), ("sadness", 208), ("surprise", 281)];
    assert_eq!(counts.into_iter().collect::<Vec<_>>(), want);
}
