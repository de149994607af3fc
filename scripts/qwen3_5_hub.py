"""Qwen3.5 (`qwen3_5`, hybrid Gated DeltaNet + gated attention) hub file contents for the tiny fixture (used by
make_tiny_checkpoints.py).

Everything here mirrors what the released Qwen/Qwen3.5-* repos (27B, 9B, 4B, ...) ship, with only the sizes shrunk:
the verbatim chat template (`chat_template.jinja`, also embedded in tokenizer_config.json), the Qwen3.5 pre-tokenizer
regex, the 33-entry added-token table, the nested config.json (`text_config` with `layer_types` / linear-attention
fields / `rope_parameters`, `vision_config` without DeepStack) and generation_config.json. The image / video
preprocessor files are the Qwen3-VL ones (same processor classes, same fields). No torch/transformers imports.

Needs transformers 5 (scripts/requirements-goldens-5.txt): 4.57 has no Qwen3.5 classes.
"""
from __future__ import annotations

import hashlib

import qwen3_vl_hub as q3

TRANSFORMERS_MAJOR = 5  # make_tiny_checkpoints / make_goldens refuse to build this family under another major version

# ----------------------------------------------------------------------------------------------
# Chat template: verbatim `chat_template.jinja` of the Qwen3.5 repos (7756 bytes, no trailing newline; the same text is
# the "chat_template" of their tokenizer_config.json). sha256 a4aee8af... is the hash pinned for
# Qwen/Qwen3.5-4B, Qwen3.5-9B, Qwen3.5-27B and Qwen3.5-35B-A3B chat_template.jinja by several independent public
# projects; the text was copied from a fixture of mlx-community/Qwen3.5-35B-A3B-4bit/chat_template.jinja and
# cross-checked against a copy "extracted from Qwen/Qwen3.5-27B tokenizer_config.json".
# Unlike Qwen3-VL's it renders content through a `render_content` macro (no images/videos in system messages),
# uses the Qwen3-Coder XML tool-call format, rebuilds `<think>` blocks for assistant turns after the last user
# query, and the generation prompt opens a thinking block: '<|im_start|>assistant\n<think>\n' by default,
# '<|im_start|>assistant\n<think>\n\n</think>\n\n' with enable_thinking=false.
# ----------------------------------------------------------------------------------------------
QWEN3_5_CHAT_TEMPLATE = r"""{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- macro render_content(content, do_vision_count, is_system_content=false) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is iterable and content is not mapping %}
        {%- for item in content %}
            {%- if 'image' in item or 'image_url' in item or item.type == 'image' %}
                {%- if is_system_content %}
                    {{- raise_exception('System message cannot contain images.') }}
                {%- endif %}
                {%- if do_vision_count %}
                    {%- set image_count.value = image_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}
                    {{- 'Picture ' ~ image_count.value ~ ': ' }}
                {%- endif %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif 'video' in item or item.type == 'video' %}
                {%- if is_system_content %}
                    {{- raise_exception('System message cannot contain videos.') }}
                {%- endif %}
                {%- if do_vision_count %}
                    {%- set video_count.value = video_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}
                    {{- 'Video ' ~ video_count.value ~ ': ' }}
                {%- endif %}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
            {%- elif 'text' in item %}
                {{- item.text }}
            {%- else %}
                {{- raise_exception('Unexpected item type in content.') }}
            {%- endif %}
        {%- endfor %}
    {%- elif content is none or content is undefined %}
        {{- '' }}
    {%- else %}
        {{- raise_exception('Unexpected content type.') }}
    {%- endif %}
{%- endmacro %}
{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\n' }}
    {{- "# Tools\n\nYou have access to the following functions:\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>" }}
    {{- '\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>' }}
    {%- if messages[0].role == 'system' %}
        {%- set content = render_content(messages[0].content, false, true)|trim %}
        {%- if content %}
            {{- '\n\n' + content }}
        {%- endif %}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {%- set content = render_content(messages[0].content, false, true)|trim %}
        {{- '<|im_start|>system\n' + content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set content = render_content(message.content, false)|trim %}
        {%- if not(content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = index %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- for message in messages %}
    {%- set content = render_content(message.content, true)|trim %}
    {%- if message.role == "system" %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- set reasoning_content = reasoning_content|trim %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if loop.first %}
                    {%- if content|trim %}
                        {{- '\n\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                    {%- else %}
                        {{- '<tool_call>\n<function=' + tool_call.name + '>\n' }}
                    {%- endif %}
                {%- else %}
                    {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                {%- endif %}
                {%- if tool_call.arguments is defined %}
                    {%- for args_name, args_value in tool_call.arguments|items %}
                        {{- '<parameter=' + args_name + '>\n' }}
                        {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                        {{- args_value }}
                        {{- '\n</parameter>\n' }}
                    {%- endfor %}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if not loop.last and loop.nextitem.role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- elif loop.last %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}"""
QWEN3_5_CHAT_TEMPLATE_SHA256 = "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715"
assert hashlib.sha256(QWEN3_5_CHAT_TEMPLATE.encode()).hexdigest() == QWEN3_5_CHAT_TEMPLATE_SHA256
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The Qwen3.5 repos name their shards model.safetensors-00001-of-0000N.safetensors (0.8B: 1 shard, 4B: 2, 9B: 4,
# 27B: 11), listed in model.safetensors.index.json like any other.
SHARD_NAME = "model.safetensors-{:05d}-of-{:05d}.safetensors"

# ----------------------------------------------------------------------------------------------
# Tokenizer. The pre-tokenizer split regex of the Qwen3.5 tokenizer.json (transformers' Qwen3_5Tokenizer
# PRETOKENIZE_REGEX, also the "pretokenize_regex" of the hub tokenizer_config.json): Qwen2's with combining marks
# kept inside letter runs ([\p{L}\p{M}]+, and \p{M} excluded from the punctuation class). Normalizer NFC, then
# Split(isolated) + ByteLevel(use_regex=false), ByteLevel decoder — as for Qwen2.
# ----------------------------------------------------------------------------------------------
QWEN3_5_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3.5 has 33 added tokens (248044..248076 in the real vocabulary of 248,044 BPE ranks, padded to 248,320 rows):
# the 14 Qwen2-VL specials, Qwen3's 12 extra tokens (special=false: <tool_call> .. </think>), then these 7 audio/TTS
# specials (special=true).
QWEN3_5_EXTRA_TOKENS = q3.QWEN3_EXTRA_TOKENS + [
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
]
MODEL_MAX_LENGTH = 262144
# Model-specific named tokens of the hub tokenizer_config.json (Qwen3VLProcessor reads image_token / video_token /
# vision_bos_token / vision_eos_token from the tokenizer).
NAMED_TOKENS = {
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
    "audio_token": "<|audio_pad|>",
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
}


def tokenizer_config(added_tokens_decoder: dict) -> dict:
    """tokenizer_config.json in the Qwen3.5 hub layout: no BOS, EOS <|im_end|>, PAD <|endoftext|>, no UNK, the
    pre-tokenizer regex, the named multimodal tokens and the chat template (also shipped as chat_template.jinja)."""
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        **{k: NAMED_TOKENS[k] for k in ("audio_bos_token", "audio_eos_token", "audio_token")},
        "bos_token": None,
        "chat_template": QWEN3_5_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "image_token": NAMED_TOKENS["image_token"],
        "model_max_length": MODEL_MAX_LENGTH,
        "model_specific_special_tokens": dict(NAMED_TOKENS),
        "pad_token": "<|endoftext|>",
        "pretokenize_regex": QWEN3_5_SPLIT_REGEX,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",  # what the hub files say; transformers 5 maps qwen3_5 to Qwen3_5Tokenizer
        "unk_token": None,
        **{k: NAMED_TOKENS[k] for k in ("video_token", "vision_bos_token", "vision_eos_token")},
    }


# ----------------------------------------------------------------------------------------------
# Tiny sizes. Real Qwen3.5-27B text: hidden 5120, 64 layers = 16 x [linear x3, full], 24 q / 4 kv heads of 256 (q_proj
# doubled for the output gate), GDN 16 key heads / 48 value heads of 128, conv kernel 4, partial rotary 0.25
# (64 rotary dims = 32 frequencies split T/H/W 11/11/10, interleaved), theta 1e7, untied lm_head, 1 MTP layer.
# Tiny: the same structure with 8 layers, head_dim 32 -> 8 rotary dims = 4 frequencies split 2/1/1.
# ----------------------------------------------------------------------------------------------
LAYER_TYPES = (["linear_attention"] * 3 + ["full_attention"]) * 2
ARCHITECTURES = {"qwen3_5": "Qwen3_5ForConditionalGeneration"}


def text_config(ids: dict, vocab_size: int) -> dict:
    # key order and extra (modeling-inert) keys as in the hub config.json (written by transformers 4.57.0.dev0)
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "dtype": "float32",
        "eos_token_id": ids["<|endoftext|>"],  # the hub text_config says 248044 (<|endoftext|>), generation uses both
        "full_attention_interval": 4,
        "head_dim": 32,  # != hidden_size / num_attention_heads (16), like the real 256 vs 5120 / 24
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "layer_types": list(LAYER_TYPES),
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,  # 2 value heads per key head, like 48 / 16 = 3 (27B) or 32 / 16 = 2 (9B)
        "linear_value_head_dim": 16,
        "max_position_embeddings": 2048,
        "mlp_only_layers": [],
        "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 4,
        "num_hidden_layers": len(LAYER_TYPES),
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": vocab_size,
        "mamba_ssm_dtype": "float32",
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [2, 1, 1],  # sums to head_dim * partial_rotary_factor / 2 = 4 (real: [11, 11, 10] = 32)
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
        },
    }


def vision_config(family: str) -> dict:
    # The Qwen3-VL tower without DeepStack (empty deepstack_visual_indexes, as in every Qwen3.5 config).
    cfg = q3.vision_config(family)
    cfg["deepstack_visual_indexes"] = []
    return cfg


def config_json(family: str, ids: dict, vocab_size: int, transformers_version: str) -> dict:
    return q3.assemble_config(ARCHITECTURES[family], family, ids, text_config(ids, vocab_size), vision_config(family), transformers_version)


# Same preprocessor files as Qwen3-VL (Qwen2VLImageProcessorFast / Qwen3VLVideoProcessor, patch 16, mean/std 0.5).
preprocessor_config = q3.preprocessor_config
video_preprocessor_config = q3.video_preprocessor_config


def generation_config(ids: dict, transformers_version: str) -> dict:
    # Qwen3.5 hub generation_config.json: thinking-mode sampling defaults (temperature 0.6, top_k 20, top_p 0.95)
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "transformers_version": transformers_version,
    }
