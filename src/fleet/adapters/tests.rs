use super::*;
use crate::fleet::prom;

const FIXTURES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/vllm-0.32.0/lora/"
);

fn fixture(name: &str) -> String {
    std::fs::read_to_string(format!("{FIXTURES}{name}")).unwrap()
}

/// The body of a captured exchange (after the blank line that ends the head).
fn body(capture: &str) -> String {
    capture
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap()
}

#[test]
fn a_real_model_list_names_each_adapter_with_its_base() {
    let listed = parse_listed(body(&fixture("models-with-adapters.http")).as_bytes()).unwrap();
    assert_eq!(
        listed,
        vec![("a0".into(), "tiny".into()), ("a1".into(), "tiny".into())]
    );
    assert_eq!(
        parse_listed(b"{\"data\":[{\"id\":\"tiny\"}]}"),
        Some(vec![])
    );
    assert_eq!(parse_listed(b"not json"), None);
}

/// The real engine's gauge under load: the series with the latest timestamp is the state.
#[test]
fn the_latest_lora_requests_info_series_is_the_state() {
    let a = Adapters::default();
    a.observe_metrics(&prom::parse(&fixture("metrics-lora-under-load.txt")));
    assert_eq!(a.max_lora(), Some(1));
    // the latest of the four series is the idle one
    let g = a.lock();
    assert!(g.running.is_empty() && g.waiting.is_empty());
    drop(g);
    a.observe_metrics(&prom::parse(
        "vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"a0,a1\",waiting_lora_adapters=\"a2\"} 20\n\
         vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 10\n",
    ));
    assert_eq!(a.max_lora(), Some(2));
    assert_eq!(a.lock().running, vec!["a0", "a1"]);
    assert_eq!(a.lock().waiting, vec!["a2"]);
    // an exposition without the gauge changes nothing
    a.observe_metrics(&prom::parse("vllm:num_requests_running 3\n"));
    assert_eq!(a.max_lora(), Some(2));
}

#[test]
fn setup_is_a_load_when_missing_or_when_every_slot_runs_another() {
    let a = Adapters::default();
    assert_eq!(a.setup("a0"), Setup::Load { measured: None });
    a.loaded("a0", "tiny", Duration::from_millis(200));
    a.loaded("a1", "tiny", Duration::from_millis(200));
    assert!((a.load_seconds().unwrap() - 0.2).abs() < 1e-9);
    let load = Setup::Load {
        measured: a.load_seconds(),
    };
    // held, slots unknown: ready
    assert_eq!(a.setup("a0"), Setup::Ready);
    a.observe_metrics(&prom::parse(
        "vllm:lora_requests_info{max_lora=\"1\",running_lora_adapters=\"a1\",waiting_lora_adapters=\"\"} 1\n",
    ));
    // a1 runs in the only slot: a0 must swap in, a1 is ready, a2 must load
    assert_eq!(a.setup("a0"), load);
    assert_eq!(a.setup("a1"), Setup::Ready);
    assert_eq!(a.setup("a2"), load);
}

#[test]
fn victims_are_the_least_recently_used_adapters_not_in_use_and_stop_counting_at_once() {
    let a = Arc::new(Adapters::default());
    a.loaded("a0", "tiny", Duration::from_millis(10));
    a.loaded("a1", "tiny", Duration::from_millis(10));
    assert!(a.take_victims(3).is_empty(), "room left for one more");
    let use_a0 = a.begin("a0");
    // a0 is in use, so a1 goes; from then on it is not held (a request would load it again)
    assert_eq!(a.take_victims(2), vec!["a1".to_string()]);
    assert!(!a.holds("a1"));
    a.loaded("a1", "tiny", Duration::from_millis(10));
    let use_a1 = a.begin("a1");
    assert!(a.take_victims(2).is_empty(), "every held adapter is in use");
    drop(use_a0);
    // down to a budget of one: both idle ones would go, but a1 is in use
    assert_eq!(a.take_victims(1), vec!["a0".to_string()]);
    drop(use_a1);
    a.loaded("a2", "tiny", Duration::from_millis(10));
    a.loaded("a3", "tiny", Duration::from_millis(10));
    // three held, budget one: all three go to make room for the next
    assert_eq!(a.take_victims(1).len(), 3);
    assert!(a.held().is_empty());
    assert_eq!(a.view().iter().map(|v| v.inflight).sum::<u32>(), 0);
}

#[test]
fn the_budget_is_configured_else_the_engines_slots_else_one() {
    let a = Adapters::default();
    assert_eq!(a.budget(None), DEFAULT_SLOTS as usize);
    assert_eq!(a.budget(Some(4)), 4);
    a.observe_metrics(&prom::parse(
        "vllm:lora_requests_info{max_lora=\"3\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 1\n",
    ));
    assert_eq!(a.budget(None), 3);
    assert_eq!(a.budget(Some(2)), 2);
}

#[test]
fn a_list_replaces_the_held_set_and_keeps_last_use() {
    let a = Arc::new(Adapters::default());
    a.loaded("a0", "tiny", Duration::from_millis(10));
    drop(a.begin("a0"));
    a.set_listed([("a1".to_string(), "tiny".to_string())]);
    assert!(!a.holds("a0"));
    assert_eq!(a.base_of("a1").as_deref(), Some("tiny"));
    a.set_listed([]);
    assert!(a.held().is_empty());
}

#[tokio::test]
async fn concurrent_loads_of_one_adapter_share_one_lock() {
    let a = Adapters::default();
    let first = a.load_lock("a0");
    let second = a.load_lock("a0");
    assert!(Arc::ptr_eq(&first, &second));
    let held = first.lock().await;
    assert!(second.try_lock().is_err());
    drop(held);
    drop((first, second));
    // an idle lock is not kept
    let _other = a.load_lock("a1");
    assert_eq!(a.loading.lock().unwrap().len(), 1);
}
