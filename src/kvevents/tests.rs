use super::*;

/// The messages of a capture file: (seq, payload bytes).
fn captured(file: &str, hex_key: &str) -> Vec<(i64, Vec<u8>)> {
    let path = format!(
        "{}/tests/fixtures/vllm-0.32.0/kv-events/{file}",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(path).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let messages = v
        .get("messages")
        .and_then(|m| m.as_array())
        .or(v.as_array())
        .unwrap();
    messages
        .iter()
        .filter(|m| m.get(hex_key).is_some())
        .map(|m| {
            (
                m["seq"].as_i64().unwrap(),
                hex::decode(m[hex_key].as_str().unwrap()).unwrap(),
            )
        })
        .collect()
}

#[test]
fn decodes_a_real_engines_batches() {
    let msgs = captured("agent-four-turns.json", "payload_msgpack_hex");
    assert_eq!(msgs.len(), 4);
    let batches: Vec<EventBatch> = msgs.iter().map(|(_, p)| decode(p).unwrap()).collect();
    let Event::BlockStored(first) = &batches[0].events[0] else {
        panic!("{:?}", batches[0]);
    };
    assert_eq!(first.block_size, 128);
    assert_eq!(first.parent_block_hash, None);
    assert_eq!(
        first.block_hashes,
        [
            EngineHash(17584577546425714013),
            EngineHash(5141898995810034200)
        ]
    );
    assert_eq!(first.token_ids.len(), 256);
    assert_eq!(&first.token_ids[..4], &[1, 4, 205, 3459]);
    assert_eq!(first.lora_name, None);
    // the second turn's new block hangs off the first turn's second block
    let Event::BlockStored(second) = &batches[1].events[0] else {
        panic!("{:?}", batches[1]);
    };
    assert_eq!(
        second.parent_block_hash,
        Some(EngineHash(5141898995810034200))
    );
    assert!(batches.iter().all(|b| b.ts > 1.7e9));
    let seqs: Vec<i64> = msgs.iter().map(|(s, _)| *s).collect();
    assert_eq!(seqs, [1, 2, 3, 4]);
}

#[test]
fn decodes_the_other_capture_too() {
    let msgs = captured("two-requests-shared-system-prompt.json", "payload_hex");
    assert!(!msgs.is_empty());
    for (_, p) in msgs {
        let b = decode(&p).unwrap();
        assert!(b
            .events
            .iter()
            .all(|e| matches!(e, Event::BlockStored(s) if s.token_ids.len() % 128 == 0)));
    }
}

#[test]
fn what_is_encoded_decodes_to_the_same_batch_and_is_an_array_of_maps() {
    let batch = EventBatch {
        ts: 1.5,
        events: vec![
            Event::BlockStored(BlockStored {
                block_hashes: vec![EngineHash(7), EngineHash(u64::MAX)],
                parent_block_hash: Some(EngineHash(3)),
                token_ids: vec![1, 2, 3, 4],
                block_size: 2,
                lora_id: None,
                medium: Some("GPU".into()),
                lora_name: Some("a".into()),
                extra_keys: Some(vec![None, None]),
                group_idx: Some(0),
                kv_cache_spec_kind: Some("full_attention".into()),
            }),
            Event::BlockRemoved(BlockRemoved {
                block_hashes: vec![EngineHash(7)],
                medium: None,
                group_idx: None,
            }),
            Event::AllBlocksCleared {},
        ],
        data_parallel_rank: None,
    };
    let bytes = encode(&batch);
    assert_eq!(bytes[0], 0x92, "a two-element array");
    assert_eq!(decode(&bytes).unwrap(), batch);
    let ranked = EventBatch {
        data_parallel_rank: Some(2),
        ..batch
    };
    let bytes = encode(&ranked);
    assert_eq!(bytes[0], 0x93);
    assert_eq!(decode(&bytes).unwrap(), ranked);
}

#[test]
fn unknown_events_and_keys_are_tolerated_and_bytes_hashes_fold() {
    // [1.0, [{"type":"Future","x":1}, {"type":"BlockRemoved","block_hashes":[b"\x01\x02"],"new":true}]]
    let v = rmpv::Value::Array(vec![
        rmpv::Value::F64(1.0),
        rmpv::Value::Array(vec![
            rmpv::Value::Map(vec![
                ("type".into(), "Future".into()),
                ("x".into(), 1.into()),
            ]),
            rmpv::Value::Map(vec![
                ("type".into(), "BlockRemoved".into()),
                (
                    "block_hashes".into(),
                    rmpv::Value::Array(vec![rmpv::Value::Binary(vec![1, 2])]),
                ),
                ("new".into(), true.into()),
            ]),
        ]),
    ]);
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &v).unwrap();
    let b = decode(&bytes).unwrap();
    assert_eq!(b.events[0], Event::Other);
    let Event::BlockRemoved(r) = &b.events[1] else {
        panic!("{b:?}");
    };
    assert_eq!(r.block_hashes, [EngineHash(fnv1a(&[1, 2]))]);
}

#[test]
fn garbage_is_an_error_not_a_panic() {
    for bad in [
        &b""[..],
        &b"\x93"[..],
        &b"\xdd\xff\xff\xff\xff"[..],
        &b"\x92\xcb\x00\x00\x00\x00\x00\x00\x00\x00\xdd\x7f\xff\xff\xff"[..],
        &[0x91; 10_000][..],
    ] {
        assert!(decode(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn sequence_frames_round_trip_and_wildcards_become_the_host() {
    assert_eq!(parse_seq(&seq_frame(42)).unwrap(), 42);
    assert_eq!(parse_seq(&seq_frame(REPLAY_END)).unwrap(), -1);
    assert!(parse_seq(b"abc").is_err());
    assert_eq!(
        dial_endpoint("tcp://*:5557", "10.0.0.2"),
        "tcp://10.0.0.2:5557"
    );
    assert_eq!(dial_endpoint("tcp://0.0.0.0:1", "h"), "tcp://h:1");
    assert_eq!(dial_endpoint("tcp://*:1", "::1"), "tcp://[::1]:1");
    assert_eq!(
        dial_endpoint("tcp://10.1.1.1:5557", "h"),
        "tcp://10.1.1.1:5557"
    );
}

#[test]
fn a_real_engines_batch_encodes_back_to_the_same_bytes() {
    // every key vLLM 0.32 sends, in its order: what the simulator encodes is what a vLLM
    // subscriber reads
    for (file, key) in [
        ("agent-four-turns.json", "payload_msgpack_hex"),
        ("two-requests-shared-system-prompt.json", "payload_hex"),
    ] {
        for (seq, bytes) in captured(file, key) {
            let batch = decode(&bytes).unwrap();
            assert_eq!(batch.data_parallel_rank, Some(0));
            assert_eq!(encode(&batch), bytes, "{file} seq {seq}");
        }
    }
}

#[test]
fn removals_and_clears_are_written_as_vllm_writes_them() {
    let batch = EventBatch {
        ts: 1.0,
        events: vec![
            Event::BlockRemoved(BlockRemoved {
                block_hashes: vec![EngineHash(1)],
                medium: Some("GPU".into()),
                group_idx: Some(0),
            }),
            Event::AllBlocksCleared {},
        ],
        data_parallel_rank: Some(0),
    };
    let v = rmpv::decode::read_value(&mut &encode(&batch)[..]).unwrap();
    let events = v[1].as_array().unwrap();
    let keys = |e: &rmpv::Value| -> Vec<String> {
        e.as_map()
            .unwrap()
            .iter()
            .map(|(k, _)| k.as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(
        keys(&events[0]),
        ["type", "block_hashes", "medium", "group_idx"]
    );
    assert_eq!(keys(&events[1]), ["type"]);
    assert_eq!(events[1]["type"].as_str(), Some("AllBlocksCleared"));
}

#[test]
fn extra_keys_fold_by_content() {
    // [1.0, [{"type":"BlockStored", ..., "extra_keys": [null, ["lora-a"], ["lora-b"], ["lora-a"]]}]]
    let stored = |extra: rmpv::Value| {
        rmpv::Value::Map(vec![
            ("type".into(), "BlockStored".into()),
            ("block_hashes".into(), rmpv::Value::Array(vec![1.into()])),
            ("parent_block_hash".into(), rmpv::Value::Nil),
            ("token_ids".into(), rmpv::Value::Array(vec![])),
            ("block_size".into(), 16.into()),
            ("extra_keys".into(), extra),
        ])
    };
    let tuple = |s: &str| rmpv::Value::Array(vec![s.into(), rmpv::Value::Binary(vec![0, 1])]);
    let v = rmpv::Value::Array(vec![
        rmpv::Value::F64(1.0),
        rmpv::Value::Array(vec![stored(rmpv::Value::Array(vec![
            rmpv::Value::Nil,
            tuple("lora-a"),
            tuple("lora-b"),
            tuple("lora-a"),
        ]))]),
    ]);
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &v).unwrap();
    let b = decode(&bytes).unwrap();
    let Event::BlockStored(s) = &b.events[0] else {
        panic!("{b:?}");
    };
    let k = s.extra_keys.as_ref().unwrap();
    assert_eq!(k[0], None);
    assert_eq!(k[1], k[3]);
    assert_ne!(k[1], k[2]);
    assert_eq!(s.group_idx, None);
}
