/* Allocation hooks: charge before the driver is called (charge.h: which device pays, the cap),
 * roll back if it fails, remember what was charged so the matching free uncharges exactly that.
 * Frees of pointers or handles the shim did not charge are forwarded without uncharging. */
#include "charge.h"
#include "hooks.h"
#include "state.h"

static uint64_t sat_mul(uint64_t a, uint64_t b)
{
    uint64_t r;
    return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}

/* ---- allocations ---------------------------------------------------------------------- */

CUresult ms_hk_cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    __typeof(ms_hk_cuMemAlloc_v2) *real = MS_REAL(cuMemAlloc_v2);
    if (real == NULL)
        return ms_no_driver("cuMemAlloc_v2");
    ms_charge c;
    CUresult rc = ms_charge_current("cuMemAlloc_v2", bytesize, &c);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(dptr, bytesize);
    return ms_charge_end_ptr("cuMemAlloc_v2", &c, rc, rc == CUDA_SUCCESS ? *dptr : 0, MS_UNDO_FREE_V2);
}
MS_EXPORT_AS(cuMemAlloc_v2)

/* 2000-era ABI: 32-bit size and pointer. */
CUresult ms_hk_cuMemAlloc(CUdeviceptr_v1 *dptr, unsigned int bytesize)
{
    __typeof(ms_hk_cuMemAlloc) *real = MS_REAL(cuMemAlloc);
    if (real == NULL)
        return ms_no_driver("cuMemAlloc");
    ms_charge c;
    CUresult rc = ms_charge_current("cuMemAlloc", bytesize, &c);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(dptr, bytesize);
    return ms_charge_end_ptr("cuMemAlloc", &c, rc, rc == CUDA_SUCCESS ? *dptr : 0, MS_UNDO_FREE_V1);
}
MS_EXPORT_AS(cuMemAlloc)

/* Charged width*height first (the least the driver can hand out), then corrected to
 * pitch*height as returned; a correction past the cap frees the allocation again. */
CUresult ms_hk_cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                                  unsigned int elementSize)
{
    __typeof(ms_hk_cuMemAllocPitch_v2) *real = MS_REAL(cuMemAllocPitch_v2);
    if (real == NULL)
        return ms_no_driver("cuMemAllocPitch_v2");
    ms_charge c;
    uint64_t estimate = sat_mul(width, height);
    CUresult rc = ms_charge_current("cuMemAllocPitch_v2", estimate, &c);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(dptr, pitch, width, height, elementSize);
    if (c.charged && rc == CUDA_SUCCESS) {
        uint64_t actual = sat_mul(*pitch, height);
        if (actual > estimate) {
            uint64_t in_use = 0;
            ms_region *r = ms_state_get()->region;
            if (ms_region_charge_q(r, c.dev, c.cap, actual - estimate, &in_use) != MS_OK) {
                ms_undo_alloc(MS_UNDO_FREE_V2, *dptr);
                ms_uncharge(c.dev, estimate);
                return ms_charge_refused("cuMemAllocPitch_v2", c.dev, c.cap, in_use, actual, MS_OVER_CAP);
            }
        } else if (actual < estimate) {
            ms_uncharge(c.dev, estimate - actual);
        }
        c.bytes = actual;
    }
    return ms_charge_end_ptr("cuMemAllocPitch_v2", &c, rc, rc == CUDA_SUCCESS ? *dptr : 0, MS_UNDO_FREE_V2);
}
MS_EXPORT_AS(cuMemAllocPitch_v2)

CUresult ms_hk_cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    __typeof(ms_hk_cuMemAllocManaged) *real = MS_REAL(cuMemAllocManaged);
    if (real == NULL)
        return ms_no_driver("cuMemAllocManaged");
    ms_charge c;
    CUresult rc = ms_charge_current("cuMemAllocManaged", bytesize, &c);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(dptr, bytesize, flags);
    return ms_charge_end_ptr("cuMemAllocManaged", &c, rc, rc == CUDA_SUCCESS ? *dptr : 0, MS_UNDO_FREE_V2);
}
MS_EXPORT_AS(cuMemAllocManaged)

/* Stream-ordered allocations. cuMemFree_v2 may free them too, so it is the undo. */
CUresult ms_hk_cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream stream)
{
    __typeof(ms_hk_cuMemAllocAsync) *real = MS_REAL(cuMemAllocAsync);
    if (real == NULL)
        return ms_no_driver("cuMemAllocAsync");
    ms_charge c;
    CUresult rc = ms_charge_current("cuMemAllocAsync", bytesize, &c);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(dptr, bytesize, stream);
    return ms_charge_end_ptr("cuMemAllocAsync", &c, rc, rc == CUDA_SUCCESS ? *dptr : 0, MS_UNDO_FREE_V2);
}
MS_EXPORT_AS(cuMemAllocAsync)

CUresult ms_hk_cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream stream)
{
    __typeof(ms_hk_cuMemAllocAsync_ptsz) *real = MS_REAL(cuMemAllocAsync_ptsz);
    if (real == NULL)
        return ms_no_driver("cuMemAllocAsync_ptsz");
    ms_charge c;
    CUresult rc = ms_charge_current("cuMemAllocAsync_ptsz", bytesize, &c);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(dptr, bytesize, stream);
    return ms_charge_end_ptr("cuMemAllocAsync_ptsz", &c, rc, rc == CUDA_SUCCESS ? *dptr : 0, MS_UNDO_FREE_V2);
}
MS_EXPORT_AS(cuMemAllocAsync_ptsz)

CUresult ms_hk_cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream stream)
{
    __typeof(ms_hk_cuMemAllocFromPoolAsync) *real = MS_REAL(cuMemAllocFromPoolAsync);
    if (real == NULL)
        return ms_no_driver("cuMemAllocFromPoolAsync");
    ms_charge c;
    CUresult rc = ms_charge_current("cuMemAllocFromPoolAsync", bytesize, &c);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(dptr, bytesize, pool, stream);
    return ms_charge_end_ptr("cuMemAllocFromPoolAsync", &c, rc, rc == CUDA_SUCCESS ? *dptr : 0, MS_UNDO_FREE_V2);
}
MS_EXPORT_AS(cuMemAllocFromPoolAsync)

CUresult ms_hk_cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream stream)
{
    __typeof(ms_hk_cuMemAllocFromPoolAsync_ptsz) *real = MS_REAL(cuMemAllocFromPoolAsync_ptsz);
    if (real == NULL)
        return ms_no_driver("cuMemAllocFromPoolAsync_ptsz");
    ms_charge c;
    CUresult rc = ms_charge_current("cuMemAllocFromPoolAsync_ptsz", bytesize, &c);
    if (rc != CUDA_SUCCESS)
        return rc;
    rc = real(dptr, bytesize, pool, stream);
    return ms_charge_end_ptr("cuMemAllocFromPoolAsync_ptsz", &c, rc, rc == CUDA_SUCCESS ? *dptr : 0, MS_UNDO_FREE_V2);
}
MS_EXPORT_AS(cuMemAllocFromPoolAsync_ptsz)

/* ---- frees ---------------------------------------------------------------------------- */

CUresult ms_hk_cuMemFree_v2(CUdeviceptr dptr)
{
    __typeof(ms_hk_cuMemFree_v2) *real = MS_REAL(cuMemFree_v2);
    if (real == NULL)
        return ms_no_driver("cuMemFree_v2");
    ms_freeing f;
    ms_free_ptr_begin(dptr, &f);
    return ms_free_ptr_end(&f, real(dptr), dptr);
}
MS_EXPORT_AS(cuMemFree_v2)

CUresult ms_hk_cuMemFree(CUdeviceptr_v1 dptr)
{
    __typeof(ms_hk_cuMemFree) *real = MS_REAL(cuMemFree);
    if (real == NULL)
        return ms_no_driver("cuMemFree");
    ms_freeing f;
    ms_free_ptr_begin(dptr, &f);
    return ms_free_ptr_end(&f, real(dptr), dptr);
}
MS_EXPORT_AS(cuMemFree)

/* The memory goes back to the pool in stream order; it is uncharged now. */
CUresult ms_hk_cuMemFreeAsync(CUdeviceptr dptr, CUstream stream)
{
    __typeof(ms_hk_cuMemFreeAsync) *real = MS_REAL(cuMemFreeAsync);
    if (real == NULL)
        return ms_no_driver("cuMemFreeAsync");
    ms_freeing f;
    ms_free_ptr_begin(dptr, &f);
    return ms_free_ptr_end(&f, real(dptr, stream), dptr);
}
MS_EXPORT_AS(cuMemFreeAsync)

CUresult ms_hk_cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream)
{
    __typeof(ms_hk_cuMemFreeAsync_ptsz) *real = MS_REAL(cuMemFreeAsync_ptsz);
    if (real == NULL)
        return ms_no_driver("cuMemFreeAsync_ptsz");
    ms_freeing f;
    ms_free_ptr_begin(dptr, &f);
    return ms_free_ptr_end(&f, real(dptr, stream), dptr);
}
MS_EXPORT_AS(cuMemFreeAsync_ptsz)
