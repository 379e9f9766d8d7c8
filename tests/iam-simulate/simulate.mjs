// Reads a JSON array of iam-simulate Simulation objects on stdin and writes one line of JSON: an
// array with, per simulation, {"result": "Allowed" | "ImplicitlyDenied" | "ExplicitlyDenied"} or
// {"error": ...} when iam-simulate refused the input (a malformed policy, an action or resource
// type it does not know). tests/iam.py is the caller.
import { runSimulation } from '@cloud-copilot/iam-simulate'

let input = ''
for await (const chunk of process.stdin) input += chunk
const out = []
for (const simulation of JSON.parse(input)) {
  const r = await runSimulation(simulation, {})
  out.push(r.resultType === 'error' ? { error: r.errors } : { result: r.overallResult })
}
process.stdout.write(JSON.stringify(out) + '\n')
