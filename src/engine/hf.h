// engine/hf.h: engine checkpoints <-> the Hugging Face layout of PaTH models (the Python package's
// pathattn.models and flash-linear-attention's PaTH models): a directory with config.json (model_type
// "path_attn") and model.safetensors holding the weights under their names (model.layers.N.attn.q_proj...).
// The two architectures are the same network: the mapping renames, transposes the engine's [In, Out]
// projections into torch's [Out, In], and splits / joins the MLP's fused gate-and-up matrix.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "engine/config.h"

namespace pathattn::engine {

// The Hugging Face config.json of a (resolved) engine model. Throws EngineError naming the model.* key the
// Hugging Face layout cannot express: attn other than path / path_fox, head_dim != d_model / n_head,
// w_rank other than 0 (a full w projection) or 32 (fla's fixed low rank).
nlohmann::json hf_config_of(const ModelConfig& m);
// The engine model a Hugging Face config.json describes (the reverse of hf_config_of). Throws EngineError
// naming the config.json key it cannot take (model_type, hidden_act, use_w_shortconv = false, attnres...).
ModelConfig model_config_of_hf(const nlohmann::json& hf);

// Writes out_dir/config.json and out_dir/model.safetensors (dtype of the checkpoint) from an engine
// checkpoint. Throws EngineError.
void export_hf(const std::string& checkpoint, const std::string& out_dir);
// Writes an engine checkpoint (step 0, AdamW moments zero) from a Hugging Face directory: the model section
// from its config.json, the task and train sections from `base`, weights from model.safetensors (F32, F64,
// BF16 or F16, converted to base.train.dtype). Every tensor of the file must be used, none may be missing
// (lm_head.weight may be absent when the embeddings are tied). Throws EngineError.
void import_hf(const std::string& hf_dir, const std::string& checkpoint, const RunConfig& base);

}  // namespace pathattn::engine
