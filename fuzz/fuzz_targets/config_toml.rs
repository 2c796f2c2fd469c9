//! Arbitrary text through the path `sluice check` takes (TOML parse, `${ENV}` interpolation,
//! validation) never panics; a refusal always names at least one problem.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match sluice::config::from_str(text, "fuzz.toml") {
        Ok(config) => {
            let _ = config.alias_map();
        }
        Err(e) => {
            let problems = e.problems();
            assert!(!problems.is_empty());
            assert!(problems.iter().all(|p| p.starts_with("fuzz.toml: ")));
        }
    }
});
