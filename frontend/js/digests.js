// What a pair of tensor digests says beyond "same" or "differs" (docs/DIGESTS.md): the help text
// for "xor / pos", and the bit-level hint when the two xor digests differ in exactly one bit.
// xor folds the tensor's 64-bit words together, so one flipped bit in the tensor flips the same
// bit of xor; a 1-bit xor difference is consistent with a single bit flip (it is also what an odd
// number of words with that same bit flipped would give: "consistent with", never "is").
// pos avalanches every change, so it says nothing about bits.

export const XOR_POS_HELP =
  "Two 64-bit digests of the tensor's bytes. xor: every 64-bit word XORed together, so one flipped bit "
  + "in the tensor flips the same bit of xor. pos: every word mixed and weighted by its place, so moved "
  + "or swapped values change it. Both equal: the bytes are the same (up to a ~2^-64 chance).";

function word(hex) {
  if (typeof hex !== "string" || !/^(0x)?[0-9a-f]{1,16}$/i.test(hex)) return null;
  return BigInt(hex.startsWith("0x") ? hex : `0x${hex}`);
}

// bits of one element of each dtype, and its fields from the top: [name, width]
const LAYOUT = {
  float32: [32, [["sign", 1], ["exponent", 8], ["mantissa", 23]]],
  float64: [64, [["sign", 1], ["exponent", 11], ["mantissa", 52]]],
  float16: [16, [["sign", 1], ["exponent", 5], ["mantissa", 10]]],
  bfloat16: [16, [["sign", 1], ["exponent", 8], ["mantissa", 7]]],
};

// "the exponent of a float32", from a bit of a little-endian 64-bit word
export function bitField(bit, dtype) {
  const name = String(dtype || "").replace(/^torch\./, "");
  const layout = LAYOUT[name];
  if (!layout) return null;
  const [width, fields] = layout;
  let b = width - 1 - (bit % width); // from the element's top bit
  for (const [field, n] of fields) {
    if (b < n) return `${field} bit of a ${name}`;
    b -= n;
  }
  return null;
}

// {bit, text} when the two xor digests differ in exactly one bit, else null
export function singleBitHint(xorA, xorB, dtype) {
  const a = word(xorA);
  const b = word(xorB);
  if (a === null || b === null || a === b) return null;
  const d = a ^ b;
  if ((d & (d - 1n)) !== 0n) return null; // more than one bit
  const bit = d.toString(2).length - 1;
  const field = bitField(bit, dtype);
  return {
    bit,
    text: `1-bit difference in xor (bit ${bit}${field ? `, a ${field}` : ""}): consistent with a single bit flip`,
  };
}
