//! Specified servers: a catalogue of common accelerators (spec-sheet figures) and the roofline
//! estimate that turns a server and a model into an engine [`Timing`].
//!
//! ```text
//! W          = params × bytes per weight                         weights, bytes
//! kv/token   = 2 × layers × kv_heads × head_dim × bytes per KV element
//! usable     = tp × (memory × 0.9 − 1.5 GB)        vLLM's gpu_memory_utilization 0.9, minus
//!                                                  CUDA context, activations and graphs
//! KV tokens  = (usable − W) / kv/token             fits when ≥ one context of the workload
//! BW, F      = tp × bandwidth × η_bw × η_tp,  tp × dense FLOP/s × η_c × η_tp
//! decode     = W / BW   +   running × (ctx × kv/token / BW + 2 × params / F)
//! prefill    = 2 × params / F  per uncached prompt token
//! ```
//!
//! A decode step reads every weight once (memory bound: `decode_base`), plus each running
//! sequence's KV cache and its share of the matrix work (`decode_per_seq`, at the workload's
//! mean context `ctx` = prompt + half the output); prefill is compute bound. η_bw = 0.7 (the
//! share of peak bandwidth decode kernels reach), η_c = 0.5 (model FLOP utilisation of
//! prefill), η_tp = 0.9 per doubling of the tensor-parallel degree (all-reduce per layer).
//! Attention's quadratic prefill term, chunked prefill and speculative decoding are ignored;
//! docs/capacity-planning.md says how far to trust the result.

use std::time::Duration;

use crate::batching::Timing;

/// One accelerator's spec-sheet figures (dense, no sparsity).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Accelerator {
    pub name: &'static str,
    /// Memory, bytes.
    pub memory: f64,
    /// Memory bandwidth, bytes/s.
    pub bandwidth: f64,
    /// Dense BF16/FP16 tensor throughput, FLOP/s.
    pub flops: f64,
    /// Board power, watts.
    pub watts: f64,
    /// Where the figures come from.
    pub source: &'static str,
}

const GB: f64 = 1e9;
const TB: f64 = 1e12;

/// The catalogue. Figures from the vendors' datasheets (dense BF16 throughput, i.e. half the
/// "with sparsity" figure those sheets also print).
pub const CATALOGUE: &[Accelerator] = &[
    Accelerator {
        name: "h100-sxm",
        memory: 80.0 * GB,
        bandwidth: 3.35 * TB,
        flops: 989.0 * TB,
        watts: 700.0,
        source: "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 80 GB HBM3, 3.35 TB/s, BF16 1,979 TFLOPS with sparsity, up to 700 W)",
    },
    Accelerator {
        name: "h100-pcie",
        memory: 80.0 * GB,
        bandwidth: 2.0 * TB,
        flops: 756.0 * TB,
        watts: 350.0,
        source: "NVIDIA H100 Tensor Core GPU datasheet (PCIe: 80 GB HBM2e, 2 TB/s, BF16 1,513 TFLOPS with sparsity, 300-350 W)",
    },
    Accelerator {
        name: "h200-sxm",
        memory: 141.0 * GB,
        bandwidth: 4.8 * TB,
        flops: 989.0 * TB,
        watts: 700.0,
        source: "NVIDIA H200 Tensor Core GPU datasheet (SXM: 141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS with sparsity, up to 700 W)",
    },
    Accelerator {
        name: "a100-sxm-80gb",
        memory: 80.0 * GB,
        bandwidth: 2.039 * TB,
        flops: 312.0 * TB,
        watts: 400.0,
        source: "NVIDIA A100 Tensor Core GPU datasheet (80 GB SXM: HBM2e 2,039 GB/s, BF16 312 TFLOPS, 400 W)",
    },
    Accelerator {
        name: "a100-pcie-40gb",
        memory: 40.0 * GB,
        bandwidth: 1.555 * TB,
        flops: 312.0 * TB,
        watts: 250.0,
        source: "NVIDIA A100 Tensor Core GPU datasheet (40 GB PCIe: HBM2 1,555 GB/s, BF16 312 TFLOPS, 250 W)",
    },
    Accelerator {
        name: "l40s",
        memory: 48.0 * GB,
        bandwidth: 864.0 * GB,
        flops: 362.0 * TB,
        watts: 350.0,
        source: "NVIDIA L40S datasheet (48 GB GDDR6, 864 GB/s, BF16 733 TFLOPS with sparsity, 350 W)",
    },
    Accelerator {
        name: "l4",
        memory: 24.0 * GB,
        bandwidth: 300.0 * GB,
        flops: 121.0 * TB,
        watts: 72.0,
        source: "NVIDIA L4 Tensor Core GPU datasheet (24 GB GDDR6, 300 GB/s, BF16 242 TFLOPS with sparsity, 72 W)",
    },
    Accelerator {
        name: "a10",
        memory: 24.0 * GB,
        bandwidth: 600.0 * GB,
        flops: 125.0 * TB,
        watts: 150.0,
        source: "NVIDIA A10 Tensor Core GPU datasheet (24 GB GDDR6, 600 GB/s, BF16 250 TFLOPS with sparsity, 150 W)",
    },
    Accelerator {
        name: "mi300x",
        memory: 192.0 * GB,
        bandwidth: 5.3 * TB,
        flops: 1307.4 * TB,
        watts: 750.0,
        source: "AMD Instinct MI300X datasheet (192 GB HBM3, 5.3 TB/s, BF16 1,307.4 TFLOPS dense, 750 W)",
    },
];

/// Look an accelerator up by its catalogue name.
pub fn accelerator(name: &str) -> Option<&'static Accelerator> {
    CATALOGUE.iter().find(|a| a.name.eq_ignore_ascii_case(name))
}

/// Share of peak memory bandwidth decode reaches.
pub const ETA_BANDWIDTH: f64 = 0.7;
/// Model FLOP utilisation of prefill.
pub const ETA_COMPUTE: f64 = 0.5;
/// Efficiency kept per doubling of the tensor-parallel degree.
pub const ETA_TP_PER_DOUBLING: f64 = 0.9;
/// vLLM's default `gpu_memory_utilization`.
pub const MEMORY_UTILISATION: f64 = 0.9;
/// Per GPU: CUDA context, activation peak, CUDA graphs.
pub const RESERVED_PER_GPU: f64 = 1.5 * GB;

/// A model's architecture.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    /// Parameters (all of them: they are all read each decode step).
    pub params: f64,
    /// Parameters active per token (mixture of experts; = `params` for dense models).
    pub active_params: f64,
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Bytes per weight (bf16/fp16 2, fp8/int8 1, int4 0.5).
    pub weight_bytes: f64,
    /// Bytes per KV-cache element.
    pub kv_bytes: f64,
}

impl ModelSpec {
    /// Weights, bytes.
    pub fn weights(&self) -> f64 {
        self.params * self.weight_bytes
    }

    /// KV cache per token, bytes.
    pub fn kv_per_token(&self) -> f64 {
        2.0 * f64::from(self.layers)
            * f64::from(self.kv_heads)
            * f64::from(self.head_dim)
            * self.kv_bytes
    }
}

/// Bytes per element of a dtype name.
pub fn dtype_bytes(dtype: &str) -> Option<f64> {
    match dtype.to_ascii_lowercase().as_str() {
        "fp32" | "float32" => Some(4.0),
        "bf16" | "fp16" | "float16" | "bfloat16" => Some(2.0),
        "fp8" | "int8" => Some(1.0),
        "int4" | "fp4" => Some(0.5),
        _ => None,
    }
}

/// The engine one tensor-parallel group of `tp` accelerators makes of a model.
#[derive(Debug, Clone, PartialEq)]
pub struct Estimate {
    pub tp: u32,
    pub timing: Timing,
    pub weights_bytes: f64,
    pub kv_per_token_bytes: f64,
}

/// Why a model does not fit.
#[derive(Debug, Clone, PartialEq)]
pub struct NoFit {
    pub tp: u32,
    pub need_bytes: f64,
    pub usable_bytes: f64,
}

/// The roofline estimate for `tp` accelerators serving `model` at mean context `ctx` tokens,
/// with room for at least `min_kv_tokens` of KV cache.
pub fn estimate(
    acc: &Accelerator,
    tp: u32,
    model: &ModelSpec,
    ctx: f64,
    min_kv_tokens: u64,
    max_num_seqs: usize,
) -> Result<Estimate, NoFit> {
    let t = f64::from(tp.max(1));
    let usable = t * (acc.memory * MEMORY_UTILISATION - RESERVED_PER_GPU);
    let w = model.weights();
    let kv = model.kv_per_token().max(1.0);
    let need = w + kv * min_kv_tokens as f64;
    if usable < need {
        return Err(NoFit {
            tp,
            need_bytes: need,
            usable_bytes: usable,
        });
    }
    let eta_tp = ETA_TP_PER_DOUBLING.powf(t.log2());
    let bw = t * acc.bandwidth * ETA_BANDWIDTH * eta_tp;
    let flops = t * acc.flops * ETA_COMPUTE * eta_tp;
    let per_token_flops = 2.0 * model.active_params;
    let timing = Timing {
        max_num_seqs: max_num_seqs.max(1),
        kv_capacity_tokens: ((usable - w) / kv) as u64,
        prefill_per_token: secs(per_token_flops / flops),
        decode_base: secs(w / bw),
        decode_per_seq: secs(ctx * kv / bw + per_token_flops / flops),
        ..Timing::default()
    };
    Ok(Estimate {
        tp,
        timing,
        weights_bytes: w,
        kv_per_token_bytes: kv,
    })
}

/// The smallest tensor-parallel degree (a power of two dividing `gpus`) at which the model
/// fits, or the last reason it does not.
pub fn smallest_fit(
    acc: &Accelerator,
    gpus: u32,
    model: &ModelSpec,
    ctx: f64,
    min_kv_tokens: u64,
    max_num_seqs: usize,
) -> Result<Estimate, NoFit> {
    let mut tp = 1;
    let mut last = None;
    while tp <= gpus.max(1) {
        if gpus % tp == 0 {
            match estimate(acc, tp, model, ctx, min_kv_tokens, max_num_seqs) {
                Ok(e) => return Ok(e),
                Err(e) => last = Some(e),
            }
        }
        tp *= 2;
    }
    Err(last.unwrap_or(NoFit {
        tp: gpus,
        need_bytes: model.weights(),
        usable_bytes: 0.0,
    }))
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(if s.is_finite() {
        s.clamp(0.0, 3600.0)
    } else {
        3600.0
    })
}

/// Ways to bring the weights to a new node, and their line rates (bytes/s).
pub const LOAD_PATHS: &[(&str, f64)] = &[
    ("10 GbE", 10e9 / 8.0),
    ("25 GbE", 25e9 / 8.0),
    ("100 GbE", 100e9 / 8.0),
    // a PCIe 4.0 x4 NVMe drive's sequential read (e.g. 7 GB/s class datasheets)
    ("local NVMe", 7.0 * GB),
];

/// Seconds to move `bytes` over each load path at line rate (a lower bound).
pub fn load_times(bytes: f64) -> Vec<(&'static str, f64)> {
    LOAD_PATHS.iter().map(|(n, r)| (*n, bytes / r)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama 3 8B's published architecture: 32 layers, 8 KV heads of 128, 8.03 B parameters.
    fn llama3_8b() -> ModelSpec {
        ModelSpec {
            params: 8.03e9,
            active_params: 8.03e9,
            layers: 32,
            kv_heads: 8,
            head_dim: 128,
            weight_bytes: 2.0,
            kv_bytes: 2.0,
        }
    }

    #[test]
    fn decode_is_bandwidth_bound_and_prefill_compute_bound() {
        let h100 = accelerator("H100-SXM").expect("in the catalogue");
        let e = estimate(h100, 1, &llama3_8b(), 1000.0, 8192, 256).expect("fits");
        // 16.06 GB read at 0.7 × 3.35 TB/s
        let base = e.timing.decode_base.as_secs_f64();
        assert!((base - 16.06e9 / (0.7 * 3.35e12)).abs() < 1e-6, "{base}");
        // 2 × 8.03 GFLOP at 0.5 × 989 TFLOP/s
        let prefill = e.timing.prefill_per_token.as_secs_f64();
        assert!((prefill - 2.0 * 8.03e9 / (0.5 * 989e12)).abs() < 1e-9);
        assert_eq!(e.kv_per_token_bytes, 131_072.0);
        // (0.9 × 80 GB − 1.5 GB − 16.06 GB) / 128 KiB
        assert_eq!(
            e.timing.kv_capacity_tokens,
            ((72e9 - 1.5e9 - 16.06e9) / 131_072.0) as u64
        );
    }

    #[test]
    fn a_model_too_big_for_one_gpu_takes_the_smallest_tp_that_fits() {
        let seventy_b = ModelSpec {
            params: 70.6e9,
            active_params: 70.6e9,
            layers: 80,
            ..llama3_8b()
        };
        let h100 = accelerator("h100-sxm").expect("in the catalogue");
        assert!(estimate(h100, 1, &seventy_b, 1000.0, 8192, 256).is_err());
        let e = smallest_fit(h100, 8, &seventy_b, 1000.0, 8192, 256).expect("fits on 8");
        assert_eq!(e.tp, 4, "141 GB of weights: not on 2 × 72 GB usable, on 4");
        let l4 = accelerator("l4").expect("in the catalogue");
        assert!(smallest_fit(l4, 2, &seventy_b, 1000.0, 8192, 256).is_err());
    }

    /// A published figure: Llama 3.1 8B Instruct (bf16) under vLLM 0.23.0 on one A100 40 GB
    /// decodes "at about 75 tokens/sec" at one request, 1024-token prompts and 128-token answers
    /// (J. Musgrave, "vLLM throughput-latency sweep on NVIDIA A100",
    /// https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on). The roofline predicts
    /// 66.7 tokens/s: a ratio of 0.89.
    #[test]
    fn the_roofline_is_near_a_published_single_request_decode_speed() {
        let a100 = accelerator("a100-pcie-40gb").expect("in the catalogue");
        let e = estimate(a100, 1, &llama3_8b(), 1024.0 + 64.0, 1152, 256).expect("fits");
        let step = (e.timing.decode_base + e.timing.decode_per_seq).as_secs_f64();
        let ratio = (1.0 / step) / 75.0;
        assert!(
            (0.85..0.95).contains(&ratio),
            "predicted/published = {ratio:.3}"
        );
    }

    #[test]
    fn load_time_is_bytes_over_line_rate() {
        let t = load_times(12.5e9);
        assert_eq!(t[2], ("100 GbE", 1.0));
        assert_eq!(t[0], ("10 GbE", 10.0));
    }
}
