// The Python module of sieve's native CPU kernels. Every kernel releases the GIL while it runs (they
// touch no Python object), so a server's event loop can stream while the engine thread computes.
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_decode_attention", &sieve::paged_decode_attention, "paged decode attention (CPU)", nogil, py::arg("q"), py::arg("k_pool"),
        py::arg("v_pool"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none(), py::arg("starts") = py::none());
  m.def("add_rms_norm", &sieve::add_rms_norm, "residual add + RMSNorm (bf16 or float32): returns (normed, sum)", nogil);
  m.def("rotary_", &sieve::rotary_, "rotary embedding in place on bf16 or float32 q/k heads", nogil);
  m.def("silu_mul", &sieve::silu_mul, "silu(gate) * up on a bf16 or float32 [T, 2I] gate|up matrix", nogil);
  m.def("apply_token_bitmask_", &sieve::apply_token_bitmask_, "-inf in float32 logits rows where a token bitmask forbids", nogil);
  m.def("dequantize_rows_q8", &sieve::dequantize_rows_q8, "rows of an int8 table with float16 group scales (an embedding lookup)", nogil);
  m.attr("isa") = SIEVE_ISA;
#if defined(SIEVE_HAS_QUANT)
  m.def("gemv_bf16", &sieve::gemv_bf16, "decode-sized GEMV, bf16 weights", nogil);
#if defined(__AVX512BF16__) || defined(__AVX2__)
  m.def("gemm_bf16_fma", &sieve::gemm_bf16_fma, "bf16 weights, any rows, float32 FMAs on widened panels", nogil);
#endif
  m.attr("gemv_max_rows") = sieve::kGemvMaxRows;
  m.def("greedy_head", &sieve::greedy_head, "argmax of a bf16 head's logits from its int8 sketch, exact", nogil, py::arg("x"),
        py::arg("w"), py::arg("codes"), py::arg("scale"), py::arg("radius"));
  m.attr("greedy_head_code_max") = sieve::greedy_head_code_max();
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
  m.def("greedy_head_q8", &sieve::greedy_head_q8, "argmax of a Q8_0 head's float32 logits from int8 activations, exact", nogil,
        py::arg("x"), py::arg("w"), py::arg("gscale"), py::arg("group"), py::arg("n"), py::arg("wnorm"));
  m.def("greedy_head_q8_max_rows", &sieve::greedy_head_q8_max_rows, "the most rows greedy_head_q8 takes (64 on AMX-INT8 tiles, else 8)");
  m.def("greedy_head_q8_amx_rows", &sieve::greedy_head_q8_amx_rows, "from how many rows its sketch runs on AMX-INT8 tiles");
  m.def("set_greedy_head_q8_amx_rows", &sieve::set_greedy_head_q8_amx_rows, "set that row count (tests); returns the one before");
#endif
  m.def("qmatmul_q8", &sieve::qmatmul_q8, "int8 / fp8-e4m3 weights with per-row or per-group scales, blocked layout", nogil);
  m.def("qmatmul_int4", &sieve::qmatmul_int4, "int4 weights in groups with a scale and min, blocked layout (optionally against int8 activations)",
        nogil, py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("min"), py::arg("group"), py::arg("bias"), py::arg("n"),
        py::arg("q8_activations") = false);
#if defined(__AVX512BF16__)
  m.def("bf16_dot_kernel", &sieve::bf16_dot_kernel, "how several rows' bf16 dot products run: fma (the same bits) or dpbf16");
  m.def("bf16_dot_fma_exact", &sieve::bf16_dot_fma_exact, "whether the two-FMA form gives vdpbf16ps's bits on this CPU");
  m.def("quantized_panel_rows", &sieve::quantized_panel_rows, "from how many rows int4 / q8_0 / int8 / fp8 weights run on float32 panels (0: never)");
  m.def("int4_amx", &sieve::use_int4_amx, "whether int4 weights multiply on AMX tiles (from int4_amx_rows() rows; FMAs in their order below)");
  m.def("set_int4_amx", &sieve::set_int4_amx, "int4 on AMX tiles or not (tests); returns the setting before");
  m.def("int4_amx_rows", &sieve::int4_amx_rows, "on AMX, from how many rows int4 takes the tiles (FMAs in their order below)");
  m.def("set_int4_amx_rows", &sieve::set_int4_amx_rows, "set that row count (tests, benchmarks); returns the one before");
  m.def("set_bf16_dot_kernel", &sieve::set_bf16_dot_kernel, "pick fma or dpbf16 (tests); returns the one before");
#endif
  m.def("q8act_kernel", &sieve::q8act_kernel, "the inner kernel int8 activations run: amx-int8, avx512-vnni or avx2");
  m.def("set_q8act_kernel", &sieve::set_q8act_kernel, "pick the int8-activation inner kernel (tests); returns the one before");
  m.def("q8act_amx_rows", &sieve::q8act_amx_rows, "under amx-int8, from how many rows a call takes the tiles (vpdpbusd below)");
  m.def("set_q8act_amx_rows", &sieve::set_q8act_amx_rows, "set that row count (tests, benchmarks); returns the one before");
#endif
  py::class_<sieve::NativeLinear, std::shared_ptr<sieve::NativeLinear>>(m, "NativeLinear")
      .def(py::init<int64_t, torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                    bool, int64_t, int64_t, int64_t, c10::optional<torch::Tensor>>(),
           py::arg("kind"), py::arg("w"), py::arg("packed"), py::arg("scale"), py::arg("aux"), py::arg("fp8"), py::arg("group"),
           py::arg("n"), py::arg("k"), py::arg("bias"))
      .def("__call__", &sieve::NativeLinear::forward, nogil)
      .def_readwrite("batch_invariant", &sieve::NativeLinear::batch_invariant)
      .def_readwrite("q8_activations", &sieve::NativeLinear::q8_activations)
      .def_readonly("kind", &sieve::NativeLinear::kind)
      .def_readonly("group", &sieve::NativeLinear::group)
      .def_readonly("n", &sieve::NativeLinear::n)
      .def_readonly("k", &sieve::NativeLinear::k)
      .def_readonly("fp8", &sieve::NativeLinear::fp8)
      .def_readonly("weight", &sieve::NativeLinear::w)
      .def_readonly("scale", &sieve::NativeLinear::scale);
  m.attr("LINEAR_BF16") = static_cast<int64_t>(sieve::NativeLinear::kBF16);
  m.attr("LINEAR_Q8") = static_cast<int64_t>(sieve::NativeLinear::kQ8);
  m.attr("LINEAR_INT4") = static_cast<int64_t>(sieve::NativeLinear::kInt4);
  m.attr("LINEAR_W8A8") = static_cast<int64_t>(sieve::NativeLinear::kW8A8);
  m.def("w8a8_native", &sieve::w8a8_native, "whether this build multiplies W8A8 weights with int8 dot products (AVX512-VNNI, AVX2)");
  m.def("w8a8_kernel", &sieve::w8a8_kernel, "the instructions this build's W8A8 kernel multiplies with (empty: none)");
  m.def("w8a8_amx", &sieve::w8a8_amx, "whether W8A8 calls of w8a8_amx_rows() rows and more multiply on AMX-INT8 tiles");
  m.def("set_w8a8_amx", &sieve::set_w8a8_amx, "turn the W8A8 AMX tiles on or off (tests); returns the setting before");
  m.def("w8a8_amx_rows", &sieve::w8a8_amx_rows, "on AMX, from how many rows a W8A8 call takes the tiles (vpdpbusd below)");
  m.def("set_w8a8_amx_rows", &sieve::set_w8a8_amx_rows, "set that row count (tests, benchmarks); returns the one before");
  m.def("w8a8_matmul", &sieve::w8a8_matmul, "int8 weights per row against int8 activations per row, blocked layout", nogil);
  py::class_<sieve::NativeDecoder>(m, "NativeDecoder")
      .def(py::init<int64_t, int64_t, int64_t, double, double, torch::Tensor, torch::Tensor, torch::Tensor>())
      .def("add_layer", &sieve::NativeDecoder::add_layer)
      .def("forward", &sieve::NativeDecoder::forward, nogil, py::arg("x"), py::arg("positions"), py::arg("slots"),
           py::arg("num_decodes"), py::arg("decode_tables"), py::arg("decode_lens"), py::arg("chunk_starts"), py::arg("chunk_lens"),
           py::arg("chunk_ctx"), py::arg("chunk_tables"), py::arg("k_pools"), py::arg("v_pools"),
           py::arg("k_scales") = std::vector<torch::Tensor>{}, py::arg("v_scales") = std::vector<torch::Tensor>{},
           py::arg("aux_layers") = std::vector<int64_t>{}, py::arg("aux") = py::none(),
           py::arg("tap_rows") = std::vector<int64_t>{}, py::arg("taps") = py::none(),
           py::arg("loras") = std::vector<std::shared_ptr<sieve::NativeLoRA>>{}, py::arg("lora_spans") = std::vector<int64_t>{},
           py::arg("reads") = nullptr);
  py::class_<sieve::LayerReads, std::shared_ptr<sieve::LayerReads>>(m, "LayerReads")
      .def(py::init<>())
      .def_readwrite("k", &sieve::LayerReads::k)
      .def_readwrite("v", &sieve::LayerReads::v)
      .def_readwrite("k_scales", &sieve::LayerReads::k_scales)
      .def_readwrite("v_scales", &sieve::LayerReads::v_scales)
      .def_readwrite("decode_tables", &sieve::LayerReads::decode_tables)
      .def_readwrite("decode_lens", &sieve::LayerReads::decode_lens)
      .def_readwrite("chunk_tables", &sieve::LayerReads::chunk_tables)
      .def_readwrite("chunk_ctx", &sieve::LayerReads::chunk_ctx);
  py::class_<sieve::NativeLoRA, std::shared_ptr<sieve::NativeLoRA>>(m, "NativeLoRA")
      .def(py::init<int64_t>())
      .def("set", &sieve::NativeLoRA::set)
      .def("apply", &sieve::NativeLoRA::apply, "y[start:end] += (x[start:end] A^T) B^T for one layer's module, float32 sums", nogil);
}
