package brokers

import (
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A kafka:// URL's user and password, with sasl=plain, are the client's
// SASL/PLAIN login, with sasl=scram-sha-256 or -512 its SCRAM login; tls=true turns TLS on; without either, the client's
// configuration is kafka's default.
func TestKafkaConfig(t *testing.T) {
	t.Parallel()
	raw := "kafka://app:s3%2Fcr3t@a:9092,b:9092?sasl=plain&tls=true"
	_, hosts, err := parse(raw)
	require.NoError(t, err)
	cfg, err := kafkaConfig(raw, hosts)
	require.NoError(t, err)
	assert.Equal(t, []string{"a:9092", "b:9092"}, cfg.Brokers)
	require.NotNil(t, cfg.Sarama)
	sasl := cfg.Sarama.Net.SASL
	assert.True(t, sasl.Enable)
	assert.Equal(t, sarama.SASLMechanism(sarama.SASLTypePlaintext), sasl.Mechanism)
	assert.Equal(t, "app", sasl.User)
	assert.Equal(t, "s3/cr3t", sasl.Password, "percent-decoded")
	assert.True(t, cfg.Sarama.Net.TLS.Enable)
	require.NoError(t, cfg.Sarama.Validate())

	cfg, err = kafkaConfig("kafka://u:p4ss@h:9092?sasl=plain", []string{"h:9092"})
	require.NoError(t, err)
	assert.False(t, cfg.Sarama.Net.TLS.Enable)
	assert.True(t, cfg.Sarama.Net.SASL.Enable)

	for mech, raw := range map[sarama.SASLMechanism]string{
		sarama.SASLTypeSCRAMSHA256: "kafka://u:p4ss@h:9092?sasl=scram-sha-256",
		sarama.SASLTypeSCRAMSHA512: "kafka://u:p4ss@h:9092?sasl=scram-sha-512&tls=true",
	} {
		cfg, err = kafkaConfig(raw, []string{"h:9092"})
		require.NoError(t, err)
		assert.Equal(t, mech, cfg.Sarama.Net.SASL.Mechanism)
		require.NotNil(t, cfg.Sarama.Net.SASL.SCRAMClientGeneratorFunc)
		require.NoError(t, cfg.Sarama.Validate(), raw)
		c := cfg.Sarama.Net.SASL.SCRAMClientGeneratorFunc()
		require.NoError(t, c.Begin("u", "p4ss", ""))
		first, err := c.Step("")
		require.NoError(t, err)
		assert.Contains(t, first, "n,,n=u,r=")
	}

	cfg, err = kafkaConfig("kafka://h:9092", []string{"h:9092"})
	require.NoError(t, err)
	assert.Nil(t, cfg.Sarama)
}
