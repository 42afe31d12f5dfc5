// tapd's XLA FFI handler for the CPU platform: XLA calls it with the tap's operands
// (and the step, last, if the tap has one); it writes them into the installed ring as
// one record, exactly as the portable backend's tapd_ring_write_leaves does. No Python
// runs on the tap path. Built into the ring's library where jaxlib's FFI headers are
// found (jax.ffi.include_dir()).

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ring.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error TapImpl(int32_t device, ffi::RemainingArgs args, ffi::RemainingRets /*token*/,
                   std::string_view entry, int64_t has_step, int64_t every, int64_t which) {
  // The site's ids in this process, by its entry (ring.h, SiteOfEntry): known once the
  // emitter lowered it, else registered now (a computation compiled elsewhere).
  uint64_t site = 0;
  uint32_t consumer = 0;
  std::string error;
  tapd::Ring* ring =
      tapd::SiteOfEntry(int32_t(which), entry.data(), entry.size(), &site, &consumer, &error);
  if (ring == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, error);
  }
  // The operands: the leaves, then the step if there is one. An ordered tap's token
  // comes as an argument too (a TOKEN buffer): it is no leaf.
  constexpr size_t kInline = 16;  // most taps: no allocation
  const void* inline_data[kInline];
  uint64_t inline_sizes[kInline];
  std::vector<const void*> more_data;
  std::vector<uint64_t> more_sizes;
  const void** data = inline_data;
  uint64_t* sizes = inline_sizes;
  if (args.size() > kInline) {
    more_data.resize(args.size());
    more_sizes.resize(args.size());
    data = more_data.data();
    sizes = more_sizes.data();
  }
  size_t count = 0;
  ffi::DataType step_type = ffi::DataType::INVALID;
  for (size_t i = 0; i < args.size(); ++i) {
    auto buffer = args.get<ffi::AnyBuffer>(i);
    if (buffer.has_error()) return buffer.error();
    if (buffer->element_type() == ffi::DataType::TOKEN) continue;
    data[count] = buffer->untyped_data();
    sizes[count] = buffer->size_bytes();
    step_type = buffer->element_type();
    ++count;
  }
  int64_t step = tapd::kNoStep;
  if (has_step) {
    if (count == 0) {
      return ffi::Error(ffi::ErrorCode::kInvalidArgument, "tapd: a tap's step is missing");
    }
    --count;  // the last operand
    step = step_type == ffi::DataType::S64 || step_type == ffi::DataType::U64
               ? *static_cast<const int64_t*>(data[count])
               : *static_cast<const int32_t*>(data[count]);
  }
  // A dormant or sampled-out tap (ring.h, SiteSlot) copies nothing; drops and skips are
  // counted in the ring.
  tapd::WriteLeaves(ring,
                    tapd::RecordFields{site, consumer, device, step, uint64_t(every)},
                    uint32_t(count), data, sizes);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TapdTap, TapImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets()  // an ordered tap's token (jaxlib < 0.10 passes it)
                                  // docs/PROTOCOL.md, "The tap's custom call"
                                  .Attr<std::string_view>("entry")
                                  .Attr<int64_t>("has_step")
                                  .Attr<int64_t>("every")
                                  .Attr<int64_t>("ring"));  // kRingDaemon, kRingLocal

// tapd's order handler (tapd/emitter/order.py): does nothing. Its custom calls exist for
// their operands and results: a tap comes after the loop whose results it takes, and a
// loop after the tap whose token its operand takes (that result aliases the operand).
// Platform-independent, so the CUDA platform registers it too.
XLA_FFI_DEFINE_HANDLER_SYMBOL(TapdOrder, [](ffi::RemainingArgs, ffi::RemainingRets) {
  return ffi::Error::Success();
}, ffi::Ffi::Bind().RemainingArgs().RemainingRets());

// The XLA FFI API version this handler was compiled against (major << 16 | minor): a
// jaxlib of the same major version and at least this minor runs it.
extern "C" uint32_t tapd_ffi_api_version_cpu() {
  return (uint32_t{XLA_FFI_API_MAJOR} << 16) | uint32_t{XLA_FFI_API_MINOR};
}
