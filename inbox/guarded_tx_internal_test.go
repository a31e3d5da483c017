package inbox

import "testing"

// The statements an optimistic run's handler may not send are told from
// the ones it may, whatever their case, blanks and leading comments.
func TestEndsTx(t *testing.T) {
	for sql, want := range map[string]bool{
		"COMMIT":                              true,
		"commit work":                         true,
		"  ;\n\tCommit;":                      true,
		"END":                                 true,
		"end transaction":                     true,
		"ABORT":                               true,
		"ROLLBACK":                            true,
		"rollback and chain":                  true,
		"ROLLBACK WORK":                       true,
		"ROLLBACK TRANSACTION":                true,
		"PREPARE TRANSACTION 'x'":             true,
		"-- note\nCOMMIT":                     true,
		"/* a /* nested */ comment */ COMMIT": true,
		"ROLLBACK TO SAVEPOINT sp":            false,
		"rollback to sp":                      false,
		"ROLLBACK WORK TO SAVEPOINT sp":       false,
		"ROLLBACK TRANSACTION TO sp":          false,
		"PREPARE ins AS INSERT INTO t VALUES (1)": false,
		"SAVEPOINT sp":                   false,
		"RELEASE SAVEPOINT sp":           false,
		"INSERT INTO commits VALUES (1)": false,
		"SELECT 'COMMIT'":                false,
		"committed":                      false,
		"ending":                         false,
		"":                               false,
		"-- COMMIT":                      false,
		"/* unterminated COMMIT":         false,
		"BEGIN":                          false,
	} {
		if got := endsTx(sql); got != want {
			t.Errorf("endsTx(%q) = %v, want %v", sql, got, want)
		}
	}
}
