"""Loading a checkpoint saved in another ``train.dtype`` (or ZeRO stage) than the run's.

What a checkpoint holds of the weights depends on how it was trained: fp32 runs and
FSDP (ZeRO-2/3, whose parameters are fp32) store ``model.<name>`` in fp32 and no masters;
bf16/fp16 runs with ZeRO 0/1 store ``model.<name>`` in the low precision and the exact
fp32 weights as ``optim.master.<name>``. So, per parameter:

- the run keeps no masters but the checkpoint has them: the weights come from the masters
  (bf16 -> fp32 keeps every bit the bf16 run had);
- the run needs masters the checkpoint lacks: they come from ``model.<name>`` (an fp32
  checkpoint's weights, exactly; DCP casts on copy) in a second pass, since one load cannot
  read one stored tensor into two places;
- fp16's loss scaler starts from ``train.loss_scale_init`` when the checkpoint has none.

Anything else the run needs and the checkpoint lacks is a refusal naming the key.
"""

from typing import Dict, Iterable, List, Tuple

from trainer3d.checkpoint.store import CheckpointError

MODEL, MASTER = "model.", "optim.master."


def load_passes(state: Dict[str, object], saved: Iterable[str]) -> Tuple[List[Dict[str, object]], List[str]]:
    """([first pass, second pass] keyed by the checkpoint's names, notes), or CheckpointError.
    ``state``: this rank's views keyed by the run's names; ``saved``: the checkpoint's keys."""
    saved = set(saved)
    first: Dict[str, object] = {}
    second: Dict[str, object] = {}
    notes: List[str] = []
    for key, value in state.items():
        name = key[len(MODEL):] if key.startswith(MODEL) else key[len(MASTER):]
        if key.startswith(MODEL) and MASTER + name not in state and MASTER + name in saved:
            first[MASTER + name] = value
        elif key in saved:
            first[key] = value
        elif key.startswith(MASTER) and MODEL + name in saved:
            second[MODEL + name] = value
        elif key.startswith("loss_scaler."):
            notes.append("the checkpoint has no fp16 loss scale: starting from train.loss_scale_init")
        elif key.startswith("moe_bias."):  # trained with another model.moe.balance
            notes.append("the checkpoint has no model.moe.balance=aux_free routing bias: starting it from zero")
        else:
            raise CheckpointError(f"the checkpoint has no {key!r}, which this run needs; "
                                  "resume with the model and train.dtype the checkpoint was saved with")
    return [first, second], sorted(set(notes))
