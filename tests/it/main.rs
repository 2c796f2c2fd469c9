//! Sluice's integration tests, as one test binary: a real gateway on loopback ports, real
//! simulators, raw misbehaving backends, the built `sluice` binary and the Python clients.
//! One module per area; everything they share is in [`support`].
//!
//! The tests of this binary run in parallel threads of one process, so process-wide state (the
//! Prometheus recorder, environment variables) is shared: a test
//! asserts on metrics of its own label sets or on before/after deltas, and a test that needs
//! the process to itself runs in a child process ([`support::isolated`]).

mod kv_routing;
mod lora_routing;
mod support;

mod api_messages;
mod api_ollama;
mod api_passthrough;
mod api_responses;
mod api_stored;
mod api_surface;
mod api_translate;
mod batch_api;
mod batch_replicas;
mod batch_sdk;
mod cli;
mod deploy_manifests;
mod failover_fleet;
mod gateway_api;
mod gateway_broken_backends;
mod gateway_errors;
mod gateway_openai_sdk;
mod gateway_panic;
mod hardening_backends;
mod hardening_connections;
mod hardening_cors;
mod hardening_inputs;
mod hardening_secrets;
mod health_fleet;
mod layering;
mod ops_admin;
mod ops_dashboard;
mod ops_demo;
mod ops_reload;
mod ops_tls;
mod ops_tracing;
mod plan_accuracy;
mod plan_cli;
mod plan_inputs;
mod plan_profile;
mod plan_report;
mod plan_selfcheck;
mod plan_trace;
mod redis_shared;
mod routing_load_aware;
mod routing_tokenize;
mod server_threads;
mod sim_cache_usage;
mod sim_config;
mod sim_engine_metrics;
mod sim_faults;
mod sim_kv_events;
mod sim_lora;
mod sim_ollama;
mod sim_python_oracles;
mod sim_tgi;
mod sim_timing;
mod sim_tokenizer;
mod sim_vllm;
mod sim_vllm_surface;
mod tenants_limits;
mod tenants_secrets;
mod tokenizer_vllm;
mod upstream_h1;
mod zero_context;
mod zero_rescue;
mod zero_resume;
