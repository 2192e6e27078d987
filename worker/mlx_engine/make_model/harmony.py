"""gpt-oss's chat format, harmony, as a Jinja chat template written from OpenAI's published description.

Every message is `<|start|>HEADER<|message|>CONTENT` closed by `<|end|>`, `<|call|>` (a tool
call: the model stops so the tool can run) or `<|return|>` (the end of the answer; in a history
it is written `<|end|>`). The conversation opens with a system message (identity, knowledge
cutoff, date, `Reasoning: low|medium|high`, the valid channels, where tool calls go) and a
developer message (`# Instructions`: the caller's system prompt; `# Tools`: the functions as a
TypeScript namespace). The assistant writes on channels: `analysis` (its reasoning), `commentary`
(tool calls, addressed `to=functions.NAME` with `<|constrain|>json`, and preambles), `final`
(the answer). Reasoning of earlier turns is dropped, except the analysis that led to a tool call
not yet answered by a final message. A tool's result comes back as
`<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>RESULT<|end|>`.

Assistant reasoning comes in `thinking` (Hugging Face's name) or `reasoning_content`; tool-call
arguments as a mapping or a JSON string; `reasoning_effort` and `model_identity` are template
arguments. `strftime_now` is transformers' date helper for chat templates.
"""

from __future__ import annotations

HARMONY_TEMPLATE = r"""
{%- set ts_names = {'string': 'string', 'integer': 'number', 'number': 'number', 'boolean': 'boolean', 'null': 'null', 'object': 'object', 'array': 'any[]'} %}
{%- macro ts_type(spec) -%}
    {%- if spec is not mapping -%}
        {{- 'any' -}}
    {%- elif spec.enum is defined -%}
        {{- spec.enum | map('tojson') | join(' | ') -}}
    {%- elif spec.type is defined and spec.type is not string -%}
        {%- for t in spec.type -%}
            {{- ts_names.get(t, 'any') -}}{{- ' | ' if not loop.last -}}
        {%- endfor -%}
    {%- elif spec.type == 'array' -%}
        {{- (ts_type(spec['items']) if spec['items'] is defined else 'any') + '[]' -}}
    {%- elif spec.type == 'object' and spec.properties -%}
        {{- '{\n' -}}
        {%- for name, prop in spec.properties | items -%}
            {{- name + ('' if name in (spec.required or []) else '?') + ': ' + ts_type(prop) + ',\n' -}}
        {%- endfor -%}
        {{- '}' -}}
    {%- else -%}
        {{- ts_names.get(spec.type, 'any') -}}
    {%- endif -%}
{%- endmacro -%}
{%- macro render_functions(tools) -%}
    {{- '## functions\n\nnamespace functions {\n\n' -}}
    {%- for tool in tools -%}
        {%- set fn = tool.function if tool.function is defined else tool -%}
        {%- if fn.description -%}
            {{- '// ' + fn.description + '\n' -}}
        {%- endif -%}
        {{- 'type ' + fn.name + ' = ' -}}
        {%- set params = fn.parameters if fn.parameters else {} -%}
        {%- if params.properties -%}
            {{- '(_: {\n' -}}
            {%- for name, prop in params.properties | items -%}
                {%- if prop.description -%}
                    {{- '// ' + prop.description + '\n' -}}
                {%- endif -%}
                {{- name + ('' if name in (params.required or []) else '?') + ': ' + ts_type(prop) + ',' -}}
                {%- if prop.default is defined -%}
                    {{- ' // default: ' + (prop.default if prop.default is string else prop.default | tojson) -}}
                {%- endif -%}
                {{- '\n' -}}
            {%- endfor -%}
            {{- '}) => any;\n\n' -}}
        {%- else -%}
            {{- '() => any;\n\n' -}}
        {%- endif -%}
    {%- endfor -%}
    {{- '} // namespace functions' -}}
{%- endmacro -%}
{#- The system message #}
{{- '<|start|>system<|message|>' }}
{{- (model_identity if model_identity is defined and model_identity else 'You are ChatGPT, a large language model trained by OpenAI.') + '\n' }}
{{- 'Knowledge cutoff: 2024-06\n' }}
{%- if strftime_now is defined %}
    {{- 'Current date: ' + strftime_now('%Y-%m-%d') + '\n' }}
{%- endif %}
{{- '\nReasoning: ' + (reasoning_effort if reasoning_effort is defined and reasoning_effort else 'medium') + '\n\n' }}
{{- '# Valid channels: analysis, commentary, final. Channel must be included for every message.' }}
{%- if tools %}
    {{- "\nCalls to these tools must go to the commentary channel: 'functions'." }}
{%- endif %}
{{- '<|end|>' }}
{#- The developer message: the caller's system prompt and the tools #}
{%- if messages and messages[0].role in ('system', 'developer') %}
    {%- set instructions = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set instructions = '' %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if instructions or tools %}
    {{- '<|start|>developer<|message|>' }}
    {%- if instructions %}
        {{- '# Instructions\n\n' + instructions }}
    {%- endif %}
    {%- if instructions and tools %}
        {{- '\n\n' }}
    {%- endif %}
    {%- if tools %}
        {{- '# Tools\n\n' + render_functions(tools) }}
    {%- endif %}
    {{- '<|end|>' }}
{%- endif %}
{#- The conversation #}
{%- set ns = namespace(calls=[], next_call=0) %}
{%- for message in loop_messages %}
    {%- if message.role == 'user' %}
        {{- '<|start|>user<|message|>' + message.content + '<|end|>' }}
    {%- elif message.role in ('system', 'developer') %}
        {{- '<|start|>developer<|message|># Instructions\n\n' + message.content + '<|end|>' }}
    {%- elif message.role == 'assistant' %}
        {%- if message.thinking is string %}
            {%- set thinking = message.thinking %}
        {%- elif message.reasoning_content is string %}
            {%- set thinking = message.reasoning_content %}
        {%- else %}
            {%- set thinking = '' %}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- set later = namespace(final=false) %}
            {%- for future in loop_messages[loop.index:] %}
                {%- if future.role == 'assistant' and not future.tool_calls %}
                    {%- set later.final = true %}
                {%- endif %}
            {%- endfor %}
            {%- if thinking and not later.final %}
                {{- '<|start|>assistant<|channel|>analysis<|message|>' + thinking + '<|end|>' }}
            {%- endif %}
            {%- if message.content %}
                {{- '<|start|>assistant<|channel|>commentary<|message|>' + message.content + '<|end|>' }}
            {%- endif %}
            {%- set ns.calls = [] %}
            {%- set ns.next_call = 0 %}
            {%- for tool_call in message.tool_calls %}
                {%- set call = tool_call.function if tool_call.function is defined else tool_call %}
                {%- set ns.calls = ns.calls + [call.name] %}
                {{- '<|start|>assistant<|channel|>commentary to=functions.' + call.name + ' <|constrain|>json<|message|>' }}
                {{- call.arguments if call.arguments is string else call.arguments | tojson }}
                {{- '<|call|>' }}
            {%- endfor %}
        {%- elif loop.last and not add_generation_prompt %}
            {%- if thinking %}
                {{- '<|start|>assistant<|channel|>analysis<|message|>' + thinking + '<|end|>' }}
            {%- endif %}
            {{- '<|start|>assistant<|channel|>final<|message|>' + (message.content or '') + '<|return|>' }}
        {%- else %}
            {{- '<|start|>assistant<|channel|>final<|message|>' + (message.content or '') + '<|end|>' }}
        {%- endif %}
    {%- elif message.role == 'tool' %}
        {%- if message.name is string and message.name %}
            {%- set name = message.name %}
        {%- elif ns.next_call < ns.calls | length %}
            {%- set name = ns.calls[ns.next_call] %}
        {%- else %}
            {{- raise_exception('A tool message must follow an assistant message with a tool call.') }}
        {%- endif %}
        {%- set ns.next_call = ns.next_call + 1 %}
        {{- '<|start|>functions.' + name + ' to=assistant<|channel|>commentary<|message|>' + message.content + '<|end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start|>assistant' }}
{%- endif %}
"""
