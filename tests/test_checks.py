"""flax_mha.checks as the pure API raises them: bad input to dot_product_attention, its weights,
split/merge_heads and the masks raises ValueError/TypeError whose message names the argument, what
was expected and what was given. `match` checks the argument name and the offending value or
shape. The front ends' and models' refusals are tested beside them (tests/nn/, tests/models/)."""

import functools

import jax
import numpy as np
import pytest

import flax_mha
from flax_mha import masks

B, T, S, H, G, K, V = 2, 5, 7, 6, 3, 11, 13
f32 = functools.partial(np.ones, dtype=np.float32)
Q, KEY, VAL = f32((B, T, H, K)), f32((B, S, G, K)), f32((B, S, G, V))
attention = flax_mha.dot_product_attention


def _call(fn, *args, **kwargs):
  return lambda: fn(*args, **kwargs)


BAD_ATTENTION = [
    # (name, call, error, match)
    ("query rank", _call(attention, f32((T, K)), KEY[0], VAL[0]), ValueError,
     r"query must have rank >= 3.*\[\.\.\., T, H, K\].*\(5, 11\)"),
    ("key rank", _call(attention, Q[0], f32((S, K)), VAL[0]), ValueError, r"key .*rank.*\(7, 11\)"),
    ("query not an array", _call(attention, [[[1.0]]], KEY, VAL), TypeError,
     "query must be an array"),
    ("integer query", _call(attention, Q.astype(np.int32), KEY, VAL), TypeError, "query.*int32"),
    ("mixed dtypes", _call(attention, Q, KEY.astype(np.float16), VAL), TypeError,
     "query, key and value.*float32, float16"),
    ("rank mismatch", _call(attention, Q, KEY[0], VAL[0]), ValueError,
     r"same rank.*\(2, 5, 6, 11\)"),
    ("batch mismatch", _call(attention, Q, f32((3, S, G, K)), f32((3, S, G, V))), ValueError,
     r"batch dims.*\(2, 5, 6, 11\), \(3, 7, 3, 11\)"),
    ("key/value length", _call(attention, Q, KEY, f32((B, S + 1, G, V))), ValueError,
     r"key.*value.*S and G.*\(2, 8, 3, 13\)"),
    ("head dim", _call(attention, Q, f32((B, S, G, K + 1)), VAL), ValueError,
     r"share the head dim K, got shapes \(2, 5, 6, 11\) and \(2, 7, 3, 12\)"),
    ("H not a multiple of G", _call(attention, Q, f32((B, S, 4, K)), f32((B, S, 4, V))), ValueError,
     "H=6 must be a multiple of .*G=4"),
    ("mask cannot broadcast", _call(attention, Q, KEY, VAL, mask=np.ones((B, H, S, T), bool)),
     ValueError,
     r"mask must broadcast to \[\.\.\., H, T, S\] = \(2, 6, 5, 7\), got shape \(2, 6, 7, 5\)"),
    ("mask grows the batch", _call(attention, Q, KEY, VAL, mask=np.ones((3, B, H, T, S), bool)),
     ValueError, r"mask must broadcast.*\(3, 2, 6, 5, 7\)"),
    ("float mask", _call(attention, Q, KEY, VAL, mask=f32((T, S))), TypeError,
     "mask must be boolean.*float32"),
    ("int mask", _call(attention, Q, KEY, VAL, mask=np.ones((T, S), np.int32)), TypeError,
     "mask must be boolean.*int32"),
    ("bias cannot broadcast", _call(attention, Q, KEY, VAL, f32((H, T, T))), ValueError,
     r"bias must broadcast.*got shape \(6, 5, 5\)"),
    ("boolean bias", _call(attention, Q, KEY, VAL, np.ones((T, S), bool)), TypeError,
     "bias must have a floating dtype, got bool"),
    ("dropout_rate 1", _call(attention, Q, KEY, VAL, dropout_rate=1.0,
                             dropout_rng=jax.random.key(0)), ValueError,
     r"dropout_rate must be a finite number in \[0, 1\), got 1.0"),
    ("dropout_rate < 0", _call(attention, Q, KEY, VAL, dropout_rate=-0.1), ValueError,
     r"dropout_rate must be a finite number in \[0, 1\), got -0.1"),
    ("dropout_rate array", _call(attention, Q, KEY, VAL, dropout_rate=np.array([0.1])),
     TypeError, "dropout_rate must be a finite number in .*, got ndarray"),
    ("missing dropout_rng", _call(attention, Q, KEY, VAL, dropout_rate=0.1), ValueError,
     "dropout_rate=0.1 needs a dropout_rng, got None"),
    ("int dropout_rng", _call(attention, Q, KEY, VAL, dropout_rate=0.1, dropout_rng=3),
     TypeError, "dropout_rng must be a jax.random.key, got int"),
    ("float dropout_rng", _call(attention, Q, KEY, VAL, dropout_rate=0.1,
                                dropout_rng=f32((2,))), TypeError, "dropout_rng.*float32"),
    ("unknown implementation", _call(attention, Q, KEY, VAL, implementation="flash9"),
     ValueError, r"implementation must be None, a callable or one of \[.*'reference'.*'xla'.*\], "
     "got 'flash9'"),
    ("implementation not a name", _call(attention, Q, KEY, VAL, implementation=3), ValueError,
     "implementation must be None, a callable or one of .* got 3"),
    ("scale nan", _call(attention, Q, KEY, VAL, scale=float("nan")), ValueError,
     "scale must be a finite number, got nan"),
    ("scale inf", _call(attention, Q, KEY, VAL, scale=float("inf")), ValueError,
     "scale must be a finite number, got inf"),
    ("several dropout keys", _call(attention, Q, KEY, VAL, dropout_rate=0.1,
                                   dropout_rng=jax.random.split(jax.random.key(0), 3)),
     ValueError, r"dropout_rng must be a single key \(shape \(\)\), got shape \(3,\)"),
    ("several raw dropout keys", _call(attention, Q, KEY, VAL, dropout_rate=0.1,
                                       dropout_rng=jax.random.split(jax.random.PRNGKey(0), 3)),
     TypeError, r"single raw uint32 key.*shape \(3, 2\)"),
    ("list query", _call(attention, Q.tolist(), KEY, VAL), TypeError,
     "query must be an array with layout"),
    ("flax float mask: how to convert", _call(attention, Q, KEY, VAL, mask=f32((T, S))),
     TypeError, r"pass mask.astype\(bool\); an additive mask \(0 / -inf\) belongs in `bias`"),
    ("is_causal not bool", _call(attention, Q, KEY, VAL, is_causal=1), TypeError,
     "is_causal must be a Python bool, got int"),
    ("scale not a number", _call(attention, Q, KEY, VAL, scale="0.1"), TypeError,
     "scale must be a finite number, got str '0.1'"),
    ("scale is an array", _call(attention, Q, KEY, VAL, scale=np.asarray(0.1)),
     TypeError, "scale must be a finite number, got ndarray"),
    ("scale is a bool", _call(attention, Q, KEY, VAL, scale=True), TypeError,
     "scale must be a finite number, got bool True"),
    ("weights: mask", _call(flax_mha.dot_product_attention_weights, Q, KEY,
                            mask=np.ones((H + 1, T, S), bool)), ValueError,
     r"mask must broadcast.*\(7, 5, 7\)"),
    ("weights: missing rng", _call(flax_mha.dot_product_attention_weights, Q, KEY,
                                   dropout_rate=0.5), ValueError, "needs a dropout_rng"),
    ("split_heads divisibility", _call(flax_mha.split_heads, f32((T, 20)), 6), ValueError,
     r"x's last dim \(20\) must be divisible by num_heads=6"),
    ("split_heads num_heads", _call(flax_mha.split_heads, f32((T, 20)), 0), ValueError,
     "num_heads must be a positive int, got 0"),
    ("merge_heads rank", _call(flax_mha.merge_heads, f32((T, 20))), ValueError,
     r"x must have rank >= 3.*\(5, 20\)"),
    ("padding_mask lengths", _call(masks.padding_mask, np.array([1.5]), 4), TypeError,
     "lengths must be integers, got dtype float"),
    ("padding_mask max_len", _call(masks.padding_mask, np.array([1]), -1), ValueError,
     "max_len must be an int >= 0, got -1"),
    ("make_attention_mask dtype", _call(masks.make_attention_mask, np.ones(T), np.ones(S, bool)),
     TypeError, "query_valid must be boolean, got dtype float"),
    ("make_attention_mask rank", _call(masks.make_attention_mask, np.ones(T, bool), np.array(True)),
     ValueError, r"key_valid must have rank >= 1.*\(\)"),
    ("combine_masks dtype", _call(masks.combine_masks, None, np.ones(T, bool), np.ones(T)),
     TypeError, r"masks\[2\] must be a boolean array, got float64"),
]


@pytest.mark.parametrize("call,error,match", [c[1:] for c in BAD_ATTENTION],
                         ids=[c[0] for c in BAD_ATTENTION])
def test_pure_functions_reject(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_checks_also_run_under_jit():
  with pytest.raises(ValueError, match="H=6 must be a multiple of .*G=4"):
    jax.jit(attention)(Q, f32((B, S, 4, K)), f32((B, S, 4, V)))
  with pytest.raises(TypeError, match="mask must be boolean"):
    jax.jit(attention)(Q, KEY, VAL, mask=f32((T, S)))
