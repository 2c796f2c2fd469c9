use super::*;

fn settings(modules: &[(&str, &str)]) -> LoraSettings {
    LoraSettings {
        enabled: true,
        modules: modules
            .iter()
            .map(|(n, p)| (n.to_string(), p.to_string()))
            .collect(),
        runtime_updating: true,
        ..LoraSettings::default()
    }
}

/// A path that exists wherever the tests run.
fn here() -> String {
    env!("CARGO_MANIFEST_DIR").to_string()
}

#[test]
fn loading_checks_in_vllms_order_and_numbers_adapters_from_one() {
    let r = Registry::new(&settings(&[("a0", &here())]), &["tiny".into()]).unwrap();
    assert_eq!(r.find("a0").map(|a| a.id()), Some(1));
    assert_eq!(
        r.load("a1", &here(), false).as_deref(),
        Ok("Success: LoRA adapter 'a1' added successfully.")
    );
    assert_eq!(r.find("a1").map(|a| a.id()), Some(2));
    assert_eq!(r.load("", "x", false), Err(LoraError::MissingNameOrPath));
    assert_eq!(
        r.load("tiny", &here(), false),
        Err(LoraError::ConflictsWithBase("tiny".into()))
    );
    // already loaded wins over a bad path, as in vLLM
    assert_eq!(
        r.load("a1", "/nonexistent/adapter", false),
        Err(LoraError::AlreadyLoaded("a1".into()))
    );
    let bad = r.load("bad", "/nonexistent/adapter", false).unwrap_err();
    assert_eq!(
        bad.to_string(),
        "Loading lora bad failed: No adapter found for /nonexistent/adapter"
    );
    assert_eq!(bad.status_and_type(), (404, "NotFoundError"));
    // the failed attempt used up id 3; loading in place keeps the name's id
    r.load("a0", &here(), true).unwrap();
    assert_eq!(r.find("a0").map(|a| a.id()), Some(1));
    r.load("a2", &here(), false).unwrap();
    assert_eq!(r.find("a2").map(|a| a.id()), Some(4));
    let names: Vec<String> = r.all().iter().map(|a| a.name().to_string()).collect();
    assert_eq!(names, ["a0", "a1", "a2"]);
}

#[test]
fn unloading_forgets_the_name_and_a_second_unload_is_not_found() {
    let r = Registry::new(&settings(&[("a1", &here())]), &["tiny".into()]).unwrap();
    assert_eq!(
        r.unload("a1").as_deref(),
        Ok("Success: LoRA adapter 'a1' removed successfully.")
    );
    let e = r.unload("a1").unwrap_err();
    assert_eq!(e.to_string(), "The lora adapter 'a1' cannot be found.");
    assert_eq!(e.status_and_type(), (404, "NotFoundError"));
    assert_eq!(r.unload(""), Err(LoraError::MissingUnloadName));
    assert!(r.find("a1").is_none());
}

#[test]
fn a_bad_module_path_fails_the_start_and_settings_are_checked_as_vllm_does() {
    assert!(Registry::new(&settings(&[("a", "/nonexistent/x")]), &["m".into()]).is_err());
    let mut s = settings(&[]);
    s.max_cpu_loras = Some(0);
    assert_eq!(
        s.validate(),
        Err("max_cpu_loras (0) must be >= max_loras (1)".into())
    );
    s.max_cpu_loras = Some(2);
    assert_eq!(s.validate(), Ok(()));
    s.enabled = false;
    assert!(
        s.validate().is_err(),
        "runtime updating needs --enable-lora"
    );
    assert_eq!(parse_module("a=/p"), Ok(("a".into(), "/p".into())));
    assert!(parse_module("a").is_err());
}

#[test]
fn slots_swap_in_what_is_missing_and_evict_the_least_recently_used() {
    let mut s = Slots::new(2);
    assert!(!s.bring(0), "the base model needs no slot");
    assert!(s.bring(1));
    assert!(s.bring(2));
    assert!(!s.bring(1), "resident");
    assert!(s.bring(3), "evicts 2, the least recently used");
    assert!(!s.bring(1));
    assert!(s.bring(2));
}

#[test]
fn prompts_under_different_adapters_never_share_blocks() {
    let r = Registry::new(
        &settings(&[("a0", &here()), ("a1", &here())]),
        &["tiny".into()],
    )
    .unwrap();
    let base = crate::batching::block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4);
    let mut a0 = base.clone();
    r.find("a0").unwrap().key_blocks(&mut a0);
    let mut a1 = base.clone();
    r.find("a1").unwrap().key_blocks(&mut a1);
    let mut a0_again = base.clone();
    r.find("a0").unwrap().key_blocks(&mut a0_again);
    assert_eq!(a0, a0_again);
    for h in &a0 {
        assert!(!base.contains(h) && !a1.contains(h));
    }
}

#[test]
fn lora_requests_info_keeps_one_series_per_state_with_the_time_last_seen() {
    let info = LoraInfo::new(1);
    info.record("a0", 1.0);
    info.record("", 2.0);
    info.record("a0", 3.5);
    let mut out = String::new();
    info.render(&mut out);
    assert_eq!(
        out,
        "# HELP vllm:lora_requests_info Running stats on lora requests.\n\
         # TYPE vllm:lora_requests_info gauge\n\
         vllm:lora_requests_info{max_lora=\"1\",running_lora_adapters=\"a0\",waiting_lora_adapters=\"a0\"} 3.5\n\
         vllm:lora_requests_info{max_lora=\"1\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 2.0\n"
    );
}

#[test]
fn lora_requests_info_lines_match_the_capture_format() {
    // a line of a real vLLM 0.32's /metrics under --max-loras 1
    let captured = "vllm:lora_requests_info{max_lora=\"1\",running_lora_adapters=\"a1\",waiting_lora_adapters=\"a1\"} 1.7965872541943045e+09";
    let info = LoraInfo::new(1);
    info.record("a1", 1.7965872541943045e9);
    let mut out = String::new();
    info.render(&mut out);
    assert_eq!(out.lines().nth(2), Some(captured));
}

#[test]
fn active_adapters_keep_the_order_they_produced_output_in() {
    let r = Registry::new(
        &settings(&[("a0", &here()), ("a1", &here())]),
        &["tiny".into()],
    )
    .unwrap();
    let (a0, a1) = (r.find("a0").unwrap(), r.find("a1").unwrap());
    let mut active = ActiveAdapters::default();
    active.update([&a1, &a0, &a1].into_iter());
    assert_eq!(active.label(), "a1,a0");
    active.update([&a0].into_iter());
    assert_eq!(active.label(), "a0");
    active.update([&a1, &a0].into_iter());
    assert_eq!(active.label(), "a0,a1");
    active.update(std::iter::empty());
    assert_eq!(active.label(), "");
}
