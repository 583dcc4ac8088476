/* Sums of 16-bit floats in C: out = round16(float32(a) + float32(b)), element-wise; and the casts between
 * float32 and float16 or bfloat16.
 *
 * Optional.  hpctrain/half.py uses it for the "sum"/"avg" of float16 and
 * bfloat16 buffers and for the casting compressors' casts when it was built,
 * and numpy's float16 / ml_dtypes' bfloat16 loops otherwise; both widen each value to float32, add, and round
 * the float32 sum once to the 16-bit type, to nearest even, so the bits are
 * the same (a NaN may differ in its payload, still a NaN).
 *
 *   float16:  x86 F16C (VCVTPH2PS / VCVTPS2PH, 8 values an instruction) where the CPU has it, chosen at run
 *             time; elsewhere the same conversion written out (IEEE binary16: subnormals, inf, NaN).
 *   bfloat16: float32's upper 16 bits; the sum's bits + 0x7FFF + (its bit 16), shifted down (round to nearest
 *             even); a NaN stays a quiet NaN.  AVX2 (8 values a step) where the CPU has it, else the same in C.
 *
 * Cost: one read of a and b and one write of out, 2 bytes a value each; numpy's float16 loop converts one
 * value at a time (about 10x slower), which made the sum, not the wire, the cost of a 16-bit all-reduce.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86 1
#endif

static int use_f16c = 0, use_avx2 = 0;     /* the CPU has F16C and AVX; AVX2 (set at import) */

/* ---- float16, portable ------------------------------------------------------------------------------------ */
static float
half_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000 | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {                                /* subnormal: normalise */
        int shift = 0;
        while (!(man & 0x400)) {
            man <<= 1;
            shift++;
        }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((man & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t
float_to_half(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    uint32_t ax = x & 0x7FFFFFFF;
    if (ax >= 0x7F800000)                   /* inf, NaN (quiet) */
        return sign | (ax > 0x7F800000 ? (uint16_t)(0x7E00 | ((ax >> 13) & 0x3FF)) : 0x7C00);
    if (ax >= 0x477FF000)                   /* rounds past 65504 */
        return sign | 0x7C00;
    if (ax < 0x38800000) {                  /* below 2^-14: a subnormal (or zero) */
        if (ax < 0x33000000)                /* below half the smallest subnormal: rounds to zero */
            return sign;
        uint32_t man = (ax & 0x7FFFFF) | 0x800000, e = ax >> 23;
        uint32_t shift = 126 - e;           /* man * 2^(e-150) in units of 2^-24 */
        uint32_t q = man >> shift, rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1)))
            q++;
        return sign | (uint16_t)q;
    }
    uint32_t r = ax + 0xFFF + ((ax >> 13) & 1); /* round the low 13 bits to nearest even */
    return sign | (uint16_t)((r - 0x38000000) >> 13);
}

static void
add_f16_portable(const uint16_t *a, const uint16_t *b, uint16_t *out, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = float_to_half(half_to_float(a[i]) + half_to_float(b[i]));
}

#ifdef HAVE_X86
__attribute__((target("avx,f16c"))) static void
add_f16_f16c(const uint16_t *a, const uint16_t *b, uint16_t *out, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i)));
        __m256 y = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i)));
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_add_ps(x, y), _MM_FROUND_TO_NEAREST_INT));
    }
    add_f16_portable(a + i, b + i, out + i, n - i);
}
#endif

/* ---- bfloat16 ------------------------------------------------------------------------------------------- */
static inline uint16_t
float_to_bf16(float f)
{
    uint32_t s;
    memcpy(&s, &f, 4);
    uint32_t nan = (s & 0x7FFFFFFF) > 0x7F800000, rounded = (s + 0x7FFF + ((s >> 16) & 1)) >> 16;
    return (uint16_t)(nan ? (s >> 16) | 0x40 : rounded);
}

static inline float
bf16_to_float(uint16_t h)
{
    uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static void
add_bf16(const uint16_t *a, const uint16_t *b, uint16_t *out, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = float_to_bf16(bf16_to_float(a[i]) + bf16_to_float(b[i]));
}

#ifdef HAVE_X86
/* 8 float32 (as int bits) rounded to bfloat16, to nearest even, NaN quieted: the scalar float_to_bf16's bits */
__attribute__((target("avx2"))) static inline __m128i
bf16_round8(__m256i s)
{
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(s, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(s, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
    __m256i q = _mm256_or_si256(_mm256_srli_epi32(s, 16), _mm256_set1_epi32(0x40));
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(s, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
    __m256i p = _mm256_packus_epi32(_mm256_blendv_epi8(r, q, nan), _mm256_setzero_si256());
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08));     /* (the two lanes' low halves) */
}

__attribute__((target("avx2"))) static inline __m256
bf16_widen8(const uint16_t *p)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

__attribute__((target("avx2"))) static Py_ssize_t
add_bf16_avx2(const uint16_t *a, const uint16_t *b, uint16_t *out, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i),
                         bf16_round8(_mm256_castps_si256(_mm256_add_ps(bf16_widen8(a + i), bf16_widen8(b + i)))));
    return i;
}
#endif

/* ---- casts ---------------------------------------------------------------------------------------------- */
enum { TO_F16 = 0, FROM_F16 = 1, TO_BF16 = 2, FROM_BF16 = 3 };

static void
convert_portable(const void *src, void *dst, Py_ssize_t n, int mode)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if (mode == TO_F16) {
            ((uint16_t *)dst)[i] = float_to_half(((const float *)src)[i]);
        } else if (mode == FROM_F16) {
            ((float *)dst)[i] = half_to_float(((const uint16_t *)src)[i]);
        } else if (mode == TO_BF16) {
            ((uint16_t *)dst)[i] = float_to_bf16(((const float *)src)[i]);
        } else {
            ((float *)dst)[i] = bf16_to_float(((const uint16_t *)src)[i]);
        }
    }
}

#ifdef HAVE_X86
__attribute__((target("avx,f16c"))) static Py_ssize_t
convert_f16c(const void *src, void *dst, Py_ssize_t n, int mode)
{
    Py_ssize_t i = 0;
    if (mode == TO_F16)
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)((uint16_t *)dst + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps((const float *)src + i), _MM_FROUND_TO_NEAREST_INT));
    else if (mode == FROM_F16)
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps((float *)dst + i,
                             _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i))));
    return i;
}

__attribute__((target("avx2"))) static Py_ssize_t
convert_bf16_avx2(const void *src, void *dst, Py_ssize_t n, int mode)
{
    Py_ssize_t i = 0;
    if (mode == TO_BF16)
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)((uint16_t *)dst + i),
                             bf16_round8(_mm256_loadu_si256((const __m256i *)((const float *)src + i))));
    else if (mode == FROM_BF16)
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps((float *)dst + i, bf16_widen8((const uint16_t *)src + i));
    return i;
}
#endif

/* ---- Python ----------------------------------------------------------------------------------------------- */

static PyObject *
add(PyObject *self, PyObject *args)
{
    Py_buffer a, b, out;
    int bf16;
    if (!PyArg_ParseTuple(args, "y*y*w*p", &a, &b, &out, &bf16))
        return NULL;
    PyObject *result = NULL;
    if (a.len != b.len || a.len != out.len || a.len % 2) {
        PyErr_SetString(PyExc_ValueError, "add: three buffers of the same even number of bytes");
        goto done;
    }
    Py_ssize_t n = a.len / 2;
    Py_BEGIN_ALLOW_THREADS
    if (bf16) {
        Py_ssize_t i = 0;
#ifdef HAVE_X86
        if (use_avx2)
            i = add_bf16_avx2(a.buf, b.buf, out.buf, n);
#endif
        add_bf16((const uint16_t *)a.buf + i, (const uint16_t *)b.buf + i, (uint16_t *)out.buf + i, n - i);
    }
#ifdef HAVE_X86
    else if (use_f16c)
        add_f16_f16c(a.buf, b.buf, out.buf, n);
#endif
    else
        add_f16_portable(a.buf, b.buf, out.buf, n);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *
convert(PyObject *self, PyObject *args)
{
    Py_buffer src, dst;
    int mode;
    if (!PyArg_ParseTuple(args, "y*w*i", &src, &dst, &mode))
        return NULL;
    PyObject *result = NULL;
    int narrowing = mode == TO_F16 || mode == TO_BF16;
    if (mode < TO_F16 || mode > FROM_BF16 || src.len % (narrowing ? 4 : 2)
        || dst.len != (narrowing ? src.len / 2 : src.len * 2)) {
        PyErr_SetString(PyExc_ValueError, "convert: float32 and 16-bit buffers of as many values, mode 0-3");
        goto done;
    }
    Py_ssize_t n = narrowing ? src.len / 4 : src.len / 2, i = 0;
    Py_BEGIN_ALLOW_THREADS
#ifdef HAVE_X86
    if (use_f16c && (mode == TO_F16 || mode == FROM_F16))
        i = convert_f16c(src.buf, dst.buf, n, mode);
    else if (use_avx2 && (mode == TO_BF16 || mode == FROM_BF16))
        i = convert_bf16_avx2(src.buf, dst.buf, n, mode);
#endif
    convert_portable((const char *)src.buf + i * (narrowing ? 4 : 2), (char *)dst.buf + i * (narrowing ? 2 : 4),
                     n - i, mode);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef methods[] = {
    {"convert", convert, METH_VARARGS,
     "convert(src, dst, mode): float32 to float16 (0), float16 to float32 (1), float32 to bfloat16 (2), bfloat16 "
     "to float32 (3), rounding to nearest even as numpy and ml_dtypes do."},
    {"add", add, METH_VARARGS,
     "add(a, b, out, bf16): out = round16(float32(a) + float32(b)) over buffers of 16-bit floats (float16, or "
     "bfloat16 when bf16); out may be a or b."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_half_kernel", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__half_kernel(void)
{
#ifdef HAVE_X86
    __builtin_cpu_init();
    use_f16c = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
    use_avx2 = __builtin_cpu_supports("avx2");
#endif
    PyObject *m = PyModule_Create(&module);
    if (m != NULL)
        PyModule_AddIntConstant(m, "f16c", use_f16c);
    return m;
}
