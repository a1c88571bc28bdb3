// nvidia-cdi-runtime: what NVIDIA's container runtime does in CDI mode, for the one-node cluster of
// scripts/cluster.sh. containerd runs it in place of runc. On `create`, a container whose
// environment has NVIDIA_VISIBLE_DEVICES (all, an index, a UUID, or a comma list of them) gets
// the CDI devices nvidia.com/gpu=<each> applied to its OCI spec from the CDI directories, as
// nvidia-container-runtime (mode cdi) applies them on a GPU node; void, none or an empty value
// gets nothing. Then it runs runc with the same arguments. Devices that no spec names fail the
// create, as the NVIDIA runtime does.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"

	spec "github.com/opencontainers/runtime-spec/specs-go"
	"tags.cncf.io/container-device-interface/pkg/cdi"
)

const kind = "nvidia.com/gpu"

// bundle returns the --bundle (-b) argument of a create command; ok is false for other commands.
func bundle(args []string) (string, bool) {
	create := false
	dir := "."
	for i := 0; i < len(args); i++ {
		a := args[i]
		switch {
		case a == "create" || a == "run":
			create = true
		case (a == "--bundle" || a == "-b") && i+1 < len(args):
			dir = args[i+1]
			i++
		case strings.HasPrefix(a, "--bundle="):
			dir = strings.TrimPrefix(a, "--bundle=")
		}
	}
	return dir, create
}

// devices maps NVIDIA_VISIBLE_DEVICES to CDI device names; nil when the variable is unset or off.
func devices(env []string) []string {
	for _, e := range env {
		value, found := strings.CutPrefix(e, "NVIDIA_VISIBLE_DEVICES=")
		if !found {
			continue
		}
		if value == "" || value == "void" || value == "none" {
			return nil
		}
		var out []string
		for _, d := range strings.Split(value, ",") {
			if d = strings.TrimSpace(d); d != "" {
				out = append(out, kind+"="+d)
			}
		}
		return out
	}
	return nil
}

func inject(dir string) error {
	path := filepath.Join(dir, "config.json")
	data, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var s spec.Spec
	if err := json.Unmarshal(data, &s); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if s.Process == nil {
		return nil
	}
	names := devices(s.Process.Env)
	if len(names) == 0 {
		return nil
	}
	cache, err := cdi.NewCache(cdi.WithSpecDirs("/etc/cdi", "/var/run/cdi"), cdi.WithAutoRefresh(false))
	if err != nil {
		return fmt.Errorf("CDI specs: %w", err)
	}
	if unresolved, err := cache.InjectDevices(&s, names...); err != nil {
		return fmt.Errorf("NVIDIA_VISIBLE_DEVICES: unresolvable CDI devices %v: %w", unresolved, err)
	}
	out, err := json.Marshal(&s)
	if err != nil {
		return err
	}
	return os.WriteFile(path, out, 0o600)
}

func main() {
	runc, err := exec.LookPath("runc")
	if err != nil {
		fmt.Fprintln(os.Stderr, "nvidia-cdi-runtime: runc not found on PATH")
		os.Exit(1)
	}
	if dir, create := bundle(os.Args[1:]); create {
		if err := inject(dir); err != nil {
			fmt.Fprintln(os.Stderr, "nvidia-cdi-runtime:", err)
			os.Exit(1)
		}
	}
	err = syscall.Exec(runc, append([]string{"runc"}, os.Args[1:]...), os.Environ())
	fmt.Fprintln(os.Stderr, "nvidia-cdi-runtime: exec runc:", err)
	os.Exit(1)
}
