package saga_test

import (
	"os"
	"os/exec"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A saga step sends its participant's step the step's own command type:
// Send takes it from the step, and a build function that makes another
// type does not compile.
func TestASagaSendsAStepOnlyItsCommandType(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("builds two programs")
	}
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go tool on PATH")
	}
	build := func(dir string) (string, error) {
		cmd := exec.Command(gobin, "build", "-o", os.DevNull, "./testdata/"+dir)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	out, err := build("match")
	require.NoError(t, err, "the matching program compiles: %s", out)
	out, err = build("mismatch")
	require.Error(t, err, "a build function of another command type must not compile")
	assert.Contains(t, out, "in call to saga.Send")
	assert.Contains(t, out, "payments.ChargePayment")
}
