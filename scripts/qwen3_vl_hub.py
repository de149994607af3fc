"""Qwen3-VL / Qwen3-VL-MoE hub file contents for the tiny fixtures (used by make_tiny_checkpoints.py).

Everything here mirrors what the released Qwen/Qwen3-VL-*-Instruct repos ship, with only the sizes
shrunk: the verbatim chat template, the Qwen3 added-token table, the nested config.json layout
(`text_config` + `vision_config`), preprocessor_config.json / video_preprocessor_config.json (with a
tiny pixel budget) and generation_config.json. No torch/transformers imports: plain data.
"""
from __future__ import annotations

import hashlib

# ----------------------------------------------------------------------------------------------
# Chat template: verbatim Qwen/Qwen3-VL-*-Instruct chat_template.json (also in tokenizer_config.json).
# Copied from github.com/NVIDIA-TAO/tao-daft src/nvidia_tao_daft/datasets/tao_vl_reason_v1_0.py
# (QWEN3VL_INSTRUCT_CHAT_TEMPLATE, documented there as "byte-identical to the chat templates shipped
# with nvidia/Cosmos-Reason2-8B and Qwen/Qwen3-VL-8B-Instruct"); cross-checked against an independent
# copy in a C++ test suite and the Qwen3-VL-30B-A3B-Instruct processor_config as listed on a hub mirror.
# Unlike Qwen2-VL's it adds NO default system prompt, accepts string or list content for every role,
# renders tool calls / tool responses (with images inside tool responses) and keeps `add_vision_id`.
# ----------------------------------------------------------------------------------------------
QWEN3_VL_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' }}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content_item in message.content %}
                {%- if 'text' in content_item %}
                    {{- content_item.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and message.content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
QWEN3_VL_CHAT_TEMPLATE_SHA256 = "3636d0f0bd6bef02654cdffdc447b79cb2cef8ab02cc75267345946291a489e4"
assert hashlib.sha256(QWEN3_VL_CHAT_TEMPLATE.encode()).hexdigest() == QWEN3_VL_CHAT_TEMPLATE_SHA256

# ----------------------------------------------------------------------------------------------
# Tokenizer: Qwen3 appends 12 added tokens to the 14 Qwen2-VL specials (151657..151668 in the real
# vocabulary). Flags as in the released Qwen3 tokenizer_config.json: all twelve are special=false
# (so they are matched as added tokens but not skipped by skip_special_tokens).
# ----------------------------------------------------------------------------------------------
QWEN3_EXTRA_TOKENS = [
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]
MODEL_MAX_LENGTH = 262144

# ----------------------------------------------------------------------------------------------
# Tiny sizes
# ----------------------------------------------------------------------------------------------
IMAGE_MEAN = [0.5, 0.5, 0.5]
IMAGE_STD = [0.5, 0.5, 0.5]
PATCH_SIZE = 16
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
# Pixel budgets (hub: images 65536..16777216, videos 4096..25165824). The video budget counts
# frames x height x width (Qwen3-VL video smart_resize), the image one height x width.
MIN_PIXELS = 32 * 32 * 4  # 4096
MAX_PIXELS = 32 * 32 * 64  # 65536
VIDEO_MIN_PIXELS = 32 * 32 * 4  # 4096
VIDEO_MAX_PIXELS = 32 * 32 * 64  # 65536
VIDEO_FPS = 2

ARCHITECTURES = {"qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"}


def text_config(family: str, ids: dict, vocab_size: int) -> dict:
    moe = family == "qwen3_vl_moe"
    cfg = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "dtype": "float32",
        "eos_token_id": ids["<|im_end|>"],
        "head_dim": 32,  # deliberately != hidden_size / num_attention_heads (16)
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 2048,
        "model_type": family + "_text",
        "num_attention_heads": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [6, 5, 5], "rope_type": "default"},
        "rope_theta": 5000000,
        "tie_word_embeddings": not moe,  # like Qwen3-VL-2B/4B (tied) vs the MoE releases (untied)
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    if moe:
        cfg.update({
            "decoder_sparse_step": 1,
            "mlp_only_layers": [3],  # layer 3 keeps a dense MLP, layers 0-2 are sparse MoE blocks
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "num_experts": 4,
            "num_experts_per_tok": 2,
        })
    return dict(sorted(cfg.items()))


def vision_config(family: str) -> dict:
    return {
        "deepstack_visual_indexes": [0, 1, 2],  # merged features added after decoder layers 0, 1, 2
        "depth": 4,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 32,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 64,
        "model_type": family,
        "num_heads": 4,
        "num_position_embeddings": 64,  # an 8x8 learned grid, bilinearly interpolated to each image grid
        "out_hidden_size": 64,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
    }


def assemble_config(architecture: str, family: str, ids: dict, text: dict, vision: dict, transformers_version: str) -> dict:
    """The hub layout every Qwen3-VL-style config.json shares (Qwen3.5 too)."""
    return {
        "architectures": [architecture],
        "image_token_id": ids["<|image_pad|>"],
        "model_type": family,
        "text_config": text,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "transformers_version": transformers_version,
        "video_token_id": ids["<|video_pad|>"],
        "vision_config": vision,
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
    }


def config_json(family: str, ids: dict, vocab_size: int, transformers_version: str) -> dict:
    return assemble_config(ARCHITECTURES[family], family, ids, text_config(family, ids, vocab_size), vision_config(family), transformers_version)


def _pixel_fields(min_pixels: int, max_pixels: int) -> dict:
    return {
        "size": {"longest_edge": max_pixels, "shortest_edge": min_pixels},
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": MERGE_SIZE,
        "image_mean": IMAGE_MEAN,
        "image_std": IMAGE_STD,
        "processor_class": "Qwen3VLProcessor",
    }


def preprocessor_config() -> dict:
    # The hub names the fast (torchvision) processor; AutoProcessor(use_fast=False) gives the slow
    # PIL Qwen2VLImageProcessor with the same parameters, which is what the goldens (and merg) use.
    return {**_pixel_fields(MIN_PIXELS, MAX_PIXELS), "image_processor_type": "Qwen2VLImageProcessorFast"}


def video_preprocessor_config() -> dict:
    return {**_pixel_fields(VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS), "video_processor_type": "Qwen3VLVideoProcessor",
            "fps": VIDEO_FPS}


def generation_config(ids: dict, transformers_version: str) -> dict:
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "top_k": 20,
        "top_p": 0.8,
        "repetition_penalty": 1.0,
        "temperature": 0.7,
        "transformers_version": transformers_version,
    }
