package brokers

import (
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The SCRAM client holds the conversation of RFC 7677's example
// (SCRAM-SHA-256, user "user", password "pencil") byte for byte, and
// refuses a server that does not prove it knows the password.
func TestSCRAMSHA256(t *testing.T) {
	t.Parallel()
	c := newSCRAM(sarama.SASLTypeSCRAMSHA256)().(*scramClient)
	c.nonce = func() (string, error) { return "rOprNGfwEbeRWgbNEkqO", nil }
	require.NoError(t, c.Begin("user", "pencil", ""))
	first, err := c.Step("")
	require.NoError(t, err)
	assert.Equal(t, "n,,n=user,r=rOprNGfwEbeRWgbNEkqO", first)
	final, err := c.Step("r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096")
	require.NoError(t, err)
	assert.Equal(t, "c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=", final)
	assert.False(t, c.Done())
	_, err = c.Step("v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=")
	require.NoError(t, err)
	assert.True(t, c.Done())

	for name, steps := range map[string][2]string{
		"a forged signature": {"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096", "v=AAAATRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="},
		"a refusal":          {"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096", "e=invalid-proof"},
		"another nonce":      {"r=someoneElse,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096", ""},
	} {
		c := newSCRAM(sarama.SASLTypeSCRAMSHA256)().(*scramClient)
		c.nonce = func() (string, error) { return "rOprNGfwEbeRWgbNEkqO", nil }
		require.NoError(t, c.Begin("user", "pencil", ""))
		_, err := c.Step("")
		require.NoError(t, err)
		_, err = c.Step(steps[0])
		if err == nil {
			_, err = c.Step(steps[1])
		}
		assert.ErrorIs(t, err, errSCRAM, name)
		if err != nil {
			assert.NotContains(t, err.Error(), "pencil", name)
		}
	}
}
