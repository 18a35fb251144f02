// Runs an AOTInductor package that calls the rope_ext ops, from C++ without Python:
//
//   aoti_runner PACKAGE.pt2 OP_LIBRARY IN OUT [IN OUT ...]
//
// OP_LIBRARY is librope_ext_ops.so (or `none`, to show what loading fails with). Each IN holds the
// model's flat inputs as a tuple of tensors (torch.save((x, positions), IN) in Python); each OUT
// receives its flat outputs as a tuple of tensors, for torch.load. The package is loaded once and
// run on every IN. Built by tests/native/aoti_runner/CMakeLists.txt, run by
// tests/test_export_aoti.py.
#include <dlfcn.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_file(const std::string& path, const std::vector<char>& data) {
  std::ofstream out(path, std::ios::binary);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

std::vector<at::Tensor> load_tensors(const std::string& path) {
  const c10::IValue tuple = torch::jit::pickle_load(read_file(path));
  std::vector<at::Tensor> tensors;
  for (const c10::IValue& v : tuple.toTupleRef().elements()) tensors.push_back(v.toTensor());
  return tensors;
}

void save_tensors(const std::string& path, const std::vector<at::Tensor>& tensors) {
  // A tuple of IValues, not a c10::List<at::Tensor>: that pickles as torch.jit's tensor list, which
  // torch.load(weights_only=True) refuses.
  std::vector<c10::IValue> values(tensors.begin(), tensors.end());
  write_file(path, torch::jit::pickle_save(c10::ivalue::Tuple::create(std::move(values))));
}

int run(int argc, char** argv) {
  if (argc < 5 || argc % 2 == 0) {
    std::fprintf(stderr, "usage: %s PACKAGE.pt2 OP_LIBRARY|none IN OUT [IN OUT ...]\n", argv[0]);
    return 2;
  }
  // The package calls rope_ext::* by name through AOTInductor's proxy executor, which looks their
  // schemas up in the dispatcher when the package is loaded: the library's static initialisers must
  // have registered them by then. RTLD_NOW fails here, not mid-run, on a library built against
  // another libtorch. Never closed: unloading would unregister the ops under the loaded model.
  if (std::string(argv[2]) != "none" && dlopen(argv[2], RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    std::fprintf(stderr, "dlopen failed: %s\n", dlerror());
    return 1;
  }
  torch::inductor::AOTIModelPackageLoader loader(argv[1]);
  for (int i = 3; i < argc; i += 2) {
    save_tensors(argv[i + 1], loader.run(load_tensors(argv[i])));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
  }
  return 1;
}
