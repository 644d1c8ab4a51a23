"""Structured outputs: a real model answers in JSON that follows a schema, picks
one of a list of choices, and fills a regex.

    python examples/structured_outputs.py /tmp/kvpage-models/SmolLM2-135M-Instruct.Q4_1.gguf

The constraint is enforced while decoding (token masks from the Rust core), so the
JSON always parses and validates, even with a 135M-parameter model.
"""

from __future__ import annotations

import argparse
import json

from kvpage import LLM, SamplingParams
from kvpage.structured_outputs import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "country": {"type": "string", "maxLength": 40},
        "capital": {"type": "string", "maxLength": 40},
        "continent": {"enum": ["Africa", "Asia", "Europe", "North America",
                               "South America", "Oceania"]},
    },
    "required": ["country", "capital", "continent"],
    "additionalProperties": False,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="HF model directory or .gguf file")
    args = parser.parse_args()
    llm = LLM(args.model, max_model_len=512, max_num_seqs=4)
    asks = [
        ("What is the capital of France? Answer in JSON with the keys country, capital "
         "and continent.", StructuredOutputsParams(json=SCHEMA)),
        ("Is the Pacific an ocean or a lake? Answer with one word.",
         StructuredOutputsParams(choice=["ocean", "lake"])),
        ("When did the Apollo 11 mission land on the Moon? Give the date as YYYY-MM-DD.",
         StructuredOutputsParams(regex=r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]")),
    ]
    for question, constraint in asks:
        messages = [{"role": "user", "content": question}]
        free, guided = llm.chat(
            [messages, messages],
            [SamplingParams(temperature=0.0, max_tokens=60),
             SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=constraint)],
            use_tqdm=False,
        )
        print(f"Q: {question}")
        print(f"  unconstrained: {free.outputs[0].text!r}")
        print(f"  {constraint.kind:>13}: {guided.outputs[0].text!r} "
              f"(finish_reason={guided.outputs[0].finish_reason})")
        if constraint.kind == "json":
            print(f"  parsed: {json.loads(guided.outputs[0].text)}")


if __name__ == "__main__":
    main()
